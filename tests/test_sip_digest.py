"""Digest authentication as ``--sip-auth`` checks it (``server/transports/sip/digest.py``):
the right answer passes once per nonce count, a replay or a wrong password does not, an old
nonce is stale, and nothing a caller sends makes the check raise. Answers come from the
client side (``DigestClient``), which the tests against Kamailio and sipp check for real."""

from __future__ import annotations

import pytest

from server.config.sip_trunks import Secret
from server.transports.sip.digest import DigestClient, DigestRealm, FailureThrottle

URI = "sip:support@127.0.0.1:5060"


def _realm(clock: list[float], algorithm: str = "MD5") -> DigestRealm:
    return DigestRealm("vocable", "pbx", Secret("s3cret"), algorithm, clock=lambda: clock[0])


@pytest.mark.parametrize("algorithm", ["MD5", "SHA-256"])
def test_the_right_answer_passes_once_per_nonce_count(algorithm: str) -> None:
    clock = [1000.0]
    realm = _realm(clock, algorithm)
    client = DigestClient("pbx", Secret("s3cret"))
    header = client.answer(401, realm.challenge(), "INVITE", URI)
    assert header is not None
    assert realm.check(header[1], "INVITE") == "ok"
    assert realm.check(header[1], "INVITE") == "bad"  # the same nonce count again: a replay
    ahead = client.ahead("INVITE", URI)  # the next request on the same nonce, nc=2
    assert ahead is not None
    assert realm.check(ahead[1], "INVITE") == "ok"
    clock[0] += 301
    later = client.ahead("INVITE", URI)
    assert later is not None
    assert realm.check(later[1], "INVITE") == "stale"
    assert "stale=true" in realm.challenge(stale=True)


def test_a_wrong_password_another_user_or_another_realm_fails() -> None:
    clock = [1000.0]
    realm = _realm(clock)
    challenge = realm.challenge()
    for user, password in (("pbx", "wrong"), ("other", "s3cret")):
        header = DigestClient(user, Secret(password)).answer(401, challenge, "INVITE", URI)
        assert header is not None
        assert realm.check(header[1], "INVITE") == "bad"
    foreign = DigestRealm("elsewhere", "pbx", Secret("s3cret")).challenge()
    header = DigestClient("pbx", Secret("s3cret")).answer(401, foreign, "INVITE", URI)
    assert header is not None
    assert realm.check(header[1], "INVITE") == "bad"


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "Basic cGJ4OnMzY3JldA==",
        'Digest username="pbx", realm="vocable", nonce="zz.é", uri="sip:x", response="é"',
        'Digest username="pbx", realm="vocable", nonce="", uri="sip:x", response=""',
        "Digest",
    ],
)
def test_what_a_caller_sends_never_makes_the_check_raise(header: str | None) -> None:
    assert _realm([1000.0]).check(header, "INVITE") in ("missing", "bad")


def test_a_source_is_throttled_after_five_failures_within_a_minute() -> None:
    now = [0.0]
    throttle = FailureThrottle(clock=lambda: now[0])
    for _ in range(4):
        throttle.failed("192.0.2.7")
    assert not throttle.refused("192.0.2.7")
    throttle.failed("192.0.2.7")
    assert throttle.refused("192.0.2.7")
    assert not throttle.refused("192.0.2.8")
    now[0] += 61
    assert not throttle.refused("192.0.2.7")
