"""RTP port pairs for SIP calls, leased and given back (``server/transports/sip/rtp_ports.py``)."""

from __future__ import annotations

import socket

import pytest

from server.transports.sip.rtp_ports import NoFreePort, RtpPorts


def _free_pair_base() -> int:
    """An even port whose pair (it and the next) is free right now, in the ephemeral range."""
    for port in range(40000, 41000, 2):
        ports = RtpPorts((port, port + 2))
        try:
            ports.lease().release()
        except NoFreePort:
            continue
        return port
    raise AssertionError("no free port pair to test with")


def test_a_lease_is_an_even_pair_and_is_given_back_once() -> None:
    base = _free_pair_base()
    ports = RtpPorts((base - 1, base + 2))  # an odd low end starts at the next even port
    lease = ports.lease()
    assert lease.port == base
    assert ports.leased == {base}
    with pytest.raises(NoFreePort, match=f"{base}-{base + 1}"):
        ports.lease()
    lease.release()
    lease.release()
    assert ports.leased == set()
    assert lease.released
    assert ports.lease().port == base


def test_a_pair_another_program_holds_is_skipped() -> None:
    base = _free_pair_base()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("", base + 1))  # only the RTCP half
        ports = RtpPorts((base, base + 2))
        with pytest.raises(NoFreePort):
            ports.lease()


def test_servers_sharing_a_range_do_not_all_start_at_its_lowest_pair() -> None:
    """Two processes that lease from the same range race for the pair they both picked (it is
    bound only once the call is answered): the search starts at a random pair."""
    picked = set()
    for _ in range(20):
        lease = RtpPorts((40000, 40200)).lease()  # a new server each time, nothing leased
        picked.add(lease.port)
        lease.release()
    assert len(picked) > 1, picked
