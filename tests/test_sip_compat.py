"""aiosipua beyond its public API, checked at start-up (``server/transports/sip/compat.py``)."""

from __future__ import annotations

import pytest
from aiosipua import IncomingCall

from server import cli
from server.transports.sip import compat as sip_compat
from server.transports.sip.compat import SipStackMismatch, check_sip_stack


def test_the_installed_aiosipua_is_a_tested_one() -> None:
    check_sip_stack()


@pytest.mark.parametrize("version", ["0.7.0", "0.8.0", "1.0", "0.6.9rc1", "unknown"])
def test_an_untested_version_is_refused_naming_what_to_install(version: str) -> None:
    with pytest.raises(SipStackMismatch) as refused:
        check_sip_stack(version)
    message = str(refused.value)
    assert f"not {version}" in message
    assert "pip install 'aiosipua>=0.7.1,<0.8.0'" in message


@pytest.mark.parametrize("version", ["0.7.1", "0.7.9", "0.7.2.post1"])
def test_the_tested_range_is_accepted(version: str) -> None:
    check_sip_stack(version)


def test_a_missing_private_member_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(IncomingCall, "_send_response")
    with pytest.raises(SipStackMismatch, match=r"lacks .*IncomingCall\._send_response"):
        check_sip_stack("0.7.1")


def test_serve_with_sip_refuses_an_untested_aiosipua_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before any model loads: exit 2 and one line, not a traceback at the first call."""
    monkeypatch.setattr(sip_compat, "TESTED_VERSIONS", ((0, 8, 0), (0, 9, 0)))
    assert cli.main(["serve", "--sip", "127.0.0.1:0", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("vocable: the SIP endpoint is tested with")
