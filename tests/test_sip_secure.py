"""Encrypted SIP calls: SIP over TLS (``--sip-tls``) and SRTP keyed in the SDP (``--sip-srtp``).

baresip, a real phone with its own TLS and SRTP, calls over TLS with SRTP mandatory: it is
understood and hears the agent. A hand-made caller reads the packets themselves: with SRTP
required, a plain RTP offer is refused with 488; an SRTP offer is answered with Vocable's own
key, every packet it sends is unreadable as G.711 on the wire and authenticates and decrypts
with that key (libsrtp) into the agent's greeting. Real Whisper, Piper and webrtcvad.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import ipaddress
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestServer
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from pylibsrtp import Policy, Session

from media import Resampler
from media.audio import SAMPLE_RATE, pcm_rms_dbfs, silence
from media.g711 import ulaw_to_pcm
from server.config.llm import ConfigError
from server.config.server import ServerConfig, SipSettings, SipTls
from server.config.sip_trunks import RegisterSettings, Secret, Trunk
from server.http.app import SIP
from server.testkit.scripted_llm import ScriptedLLM, answers_by_words
from server.testkit.sip_phone import SipPhone
from tests.support.baresip import RATE, loud_frames, start_baresip, until
from tests.support.calls import events_of, transcriber, voice_server, word_error_rate
from tests.support.dns_stub import dns_stub
from tests.support.kamailio import PBX_CONFIG, run_kamailio
from tests.support.outbound import call_ended, post_call
from tests.support.phone import ANSWER, phone_audio
from tests.support.processes import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

QUESTION = "Where is my order?"
GREETING_S = 4.5
"""The support playbook's greeting, which plays while the caller is silent."""


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and ``sip.test`` (a trunk's domain) and its
    key (PEM files)."""
    folder = tmp_path_factory.mktemp("tls")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("sip.test")]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@pytest.fixture
async def server(llm: ScriptedLLM, certificate: tuple[Path, Path]) -> AsyncIterator[TestServer]:
    llm.script(answers_by_words({}, ANSWER))
    tls = SipTls("127.0.0.1", free_port(), *certificate)
    sip = SipSettings(host="127.0.0.1", port=0, srtp="required", tls=tls)
    async with voice_server(llm.base_url, ServerConfig(sip=sip)) as server:
        yield server


async def test_baresip_over_tls_with_srtp_is_understood_and_hears_the_agent(
    server: TestServer, llm: ScriptedLLM, tmp_path: Path, certificate: tuple[Path, Path]
) -> None:
    sip = server.app[SIP]
    tls = sip.settings.tls
    assert tls is not None
    # it hangs up once it has heard the answer (~4 s after the question): the silence after the
    # question is an upper bound
    speech = silence(round(GREETING_S * 1000), RATE) + phone_audio(QUESTION) + silence(12000, RATE)
    phone = await start_baresip(
        tmp_path / "caller",
        speech,
        account="caller;mediaenc=srtp-mand",
        dial=f"sip:support@127.0.0.1:{tls.port};transport=tls",
        extra_config=f"module\t\t\tsrtp.so\nsip_cafile\t\t{certificate[0]}\n",
    )
    try:
        await until(lambda: bool(sip.calls), 10, "baresip's call over TLS was not answered", phone)
        (call,) = sip.calls.values()
        await until(  # the greeting's tts_end, then the answer's
            lambda: events_of(call, "tts_end") >= 2,
            len(speech) / 2 / RATE,
            "the agent did not answer",
            phone,
        )
        # (and half a second of the agent's silence after the answer: Whisper misreads a
        # recording's last word with no pause after it, "Callin" for "calling")
        await phone.hears_more(0.8)
        phone.process.terminate()  # it hangs up (a BYE) and quits, its recordings complete
        await until(call.ended.is_set, 10, "it did not end", phone)
        await asyncio.wait_for(phone.process.wait(), 5)
    finally:
        await phone.stop()
    assert call.srtp is not None, "the call is not on SRTP"
    (asked,) = llm.user_turns
    # ("Where's" spelled out: Whisper writes either, as test_sip_baresip's _wer allows)
    assert word_error_rate(f"{asked} ".replace("'s ", " is "), QUESTION) <= 0.25, asked
    heard = phone.heard()
    assert loud_frames(heard[: int(GREETING_S * RATE) * 2]), "baresip heard no greeting"
    resampler = Resampler(RATE, SAMPLE_RATE)
    after = heard[int((GREETING_S + 1.5) * RATE) * 2 :]
    said = (await transcriber().transcribe(resampler.resample(after) + resampler.flush())).text
    assert word_error_rate(said, ANSWER) <= 0.3, said


class _Wire(asyncio.DatagramProtocol):
    """A caller's RTP port that keeps every packet as it arrives."""

    def __init__(self) -> None:
        self.packets: list[bytes] = []

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.packets.append(data)


@pytest.fixture
async def wire() -> AsyncIterator[tuple[int, _Wire]]:
    loop = asyncio.get_running_loop()
    transport, wire = await loop.create_datagram_endpoint(_Wire, local_addr=("127.0.0.1", 0))
    try:
        yield int(transport.get_extra_info("sockname")[1]), wire
    finally:
        transport.close()


def _srtp_offer(port: int, key: bytes) -> str:
    inline = base64.b64encode(key).decode()
    return "\r\n".join(
        [
            "v=0",
            "o=phone 1 1 IN IP4 127.0.0.1",
            "s=-",
            "c=IN IP4 127.0.0.1",
            "t=0 0",
            f"m=audio {port} RTP/SAVP 0",
            "a=rtpmap:0 PCMU/8000",
            f"a=crypto:1 AES_CM_128_HMAC_SHA1_80 inline:{inline}",
            "a=sendrecv",
            "",
        ]
    )


def _levels(pcm8k: bytes) -> Iterator[float]:
    return (pcm_rms_dbfs(pcm8k[i : i + 320]) for i in range(0, len(pcm8k) - 319, 320))


def _rtp(packets: list[bytes]) -> list[bytes]:
    """The RTP packets among ``packets`` (not RTCP)."""
    return [p for p in packets if len(p) > 12 and not 192 <= p[1] <= 223]


def _decrypted(answer: str, rtp: list[bytes]) -> bytes:
    """``rtp`` (SRTP packets) authenticated and decrypted with the key of the SDP ``answer``'s
    ``a=crypto`` line, as G.711 decoded to 8 kHz PCM16."""
    (crypto,) = [line for line in answer.splitlines() if line.startswith("a=crypto:")]
    key = base64.b64decode(crypto.split()[2].removeprefix("inline:"))
    profile = Policy.SRTP_PROFILE_AES128_CM_SHA1_80
    inbound = Session(Policy(key=key, ssrc_type=Policy.SSRC_ANY_INBOUND, srtp_profile=profile))
    return b"".join(ulaw_to_pcm(inbound.unprotect(p)[12:]) for p in rtp)


def _greeting_sent(answer: str, packets: list[bytes]) -> bool:
    """Whether 2 s of packets came, and the greeting is loud in them."""
    rtp = _rtp(packets)
    return len(rtp) >= 100 and sum(level > -45 for level in _levels(_decrypted(answer, rtp))) > 20


async def test_srtp_on_the_wire_is_unreadable_and_decrypts_with_the_sdes_key(
    server: TestServer, wire: tuple[int, _Wire]
) -> None:
    port, received = wire
    plain = await SipPhone.open(server.app[SIP].port)
    phone = await SipPhone.open(server.app[SIP].port)
    try:
        refused = await plain.invite()  # plain RTP, and SRTP is required
        phone.request("INVITE", "support", _srtp_offer(port, secrets.token_bytes(30)))
        answer = await phone.response(10.0)
        phone.invite_cseq = phone.cseq
        phone.ack(answer)
        # the greeting, on the wire: 2 s of packets, the greeting's start among them (it starts
        # within a second)
        await until(
            lambda: answer.status_code != 200 or _greeting_sent(answer.text, received.packets),
            10,
            "no greeting on the wire",
        )
        await phone.bye()
    finally:
        await plain.close()
        await phone.close()

    assert refused.status_code == 488
    assert "requires SRTP" in (refused.headers.get_first("warning") or "")
    assert answer.status_code == 200
    (crypto,) = [line for line in answer.text.splitlines() if line.startswith("a=crypto:")]
    assert "RTP/SAVP" in answer.text
    suite = crypto.split()[1]
    assert suite == "AES_CM_128_HMAC_SHA1_80"
    rtp = _rtp(received.packets)
    assert len(rtp) >= 100, len(rtp)  # 20 ms packets for 2 s or more
    on_the_wire = b"".join(ulaw_to_pcm(p[12:-10]) for p in rtp)  # as if it were G.711
    clear = _decrypted(answer.text, rtp)
    wire_levels, clear_levels = list(_levels(on_the_wire)), list(_levels(clear))
    assert min(wire_levels) > -20, "a packet on the wire reads as quiet G.711"
    assert sum(level > -45 for level in clear_levels) > 20, "the greeting is not in the packets"
    assert sum(level < -60 for level in clear_levels) > 3, "no silence before the greeting"


def test_a_certificate_that_does_not_match_its_key_is_refused_in_one_line(
    certificate: tuple[Path, Path], tmp_path: Path
) -> None:
    other = tmp_path / "other.pem"
    other.write_bytes(
        ec.generate_private_key(ec.SECP256R1()).private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    with pytest.raises(ConfigError) as refused:
        SipTls("127.0.0.1", 5061, certificate[0], other).context()
    assert str(refused.value) == (
        f"--sip-tls: cannot use {certificate[0]} with {other}: KEY_VALUES_MISMATCH"
    )
    with pytest.raises(ConfigError, match="no such file"):
        SipTls("127.0.0.1", 5061, tmp_path / "missing.pem", other).context()


async def test_a_trunk_on_tls_checks_the_proxys_certificate_and_calls_through_it(
    llm: ScriptedLLM, tmp_path: Path, certificate: tuple[Path, Path]
) -> None:
    cert, key = certificate
    both = tmp_path / "callee.pem"  # baresip reads its certificate and key from one file
    both.write_bytes(cert.read_bytes() + key.read_bytes())
    callee = await start_baresip(  # it says "Hello?" and takes SRTP calls only
        tmp_path / "callee",
        # (an upper bound: it hangs up once it has heard the agent)
        silence(300, RATE) + phone_audio("Hello?") + silence(10000, RATE),
        account="callee;answermode=auto;mediaenc=srtp-mand",
        extra_config=f"sip_certificate\t\t{both}\nmodule\t\t\tsrtp.so\n",
    )
    records = {  # the trunk's domain publishes its SIP over TLS (RFC 3263), on baresip's
        ("sip.test", "NAPTR"): ['10 50 "s" "SIP+D2U" "" _sip._udp.sip.test.',
                                '20 50 "s" "SIPS+D2T" "" _sips._tcp.sip.test.'],
        ("_sips._tcp.sip.test", "SRV"): [f"10 0 {callee.sip_port + 1} edge.sip.test."],
        ("edge.sip.test", "A"): ["127.0.0.1"],
    }  # fmt: skip
    try:
        async with dns_stub(records) as dns:
            proxy = ("sip.test", None)
            trunks = {
                "tls": Trunk("tls", proxy=proxy, transport="tls", ca_file=cert, srtp=True),
                "untrusted": Trunk("untrusted", proxy=proxy, transport="tls"),  # system CAs
            }
            tls = SipTls("127.0.0.1", free_port(), cert, key)
            sip = SipSettings(
                host="127.0.0.1", port=0, trunks=trunks, tls=tls, dns_server=("127.0.0.1", dns.port)
            )
            async with voice_server(llm.base_url, ServerConfig(sip=sip)) as server:
                refused = await call_ended(server, {"to": "callee", "trunk": "untrusted"})
                status, placed = await post_call(server, {"to": "callee", "trunk": "tls"})
                assert status == 201, placed
                call = server.app[SIP].outbound[placed["session_id"]]
                # once the agent's greeting (after the callee's "Hello?") has played for 0.5 s
                # at the callee, it hangs up (a BYE) and quits, its recordings complete
                await until(
                    lambda: events_of(call, "tts_start") >= 1 or call.state == "ended",
                    20,
                    "no greeting",
                    callee,
                )
                if call.state != "ended":
                    await callee.hears_more(0.5)
                    callee.process.terminate()
                await until(lambda: call.state == "ended", 10, "the call did not end", callee)
                await asyncio.wait_for(callee.process.wait(), 5)
                answered = call.describe()
                pickup = call.pickup
    finally:
        await callee.stop()
    assert ("_sips._tcp.sip.test", "SRV") in dns.asked  # the NAPTR record for TLS, not UDP's
    assert refused["result"] == "failed"
    assert "certificate verify failed" in refused["reason"], refused
    assert answered["result"] == "answered", answered
    assert answered["reason"] == "the callee hung up", answered
    # on SRTP both ways: the callee's "Hello?" was decrypted and heard, and it heard the agent
    assert answered["srtp"] is True, answered
    assert pickup is not None
    assert pickup.verdict == "person", pickup.heard_ms
    assert loud_frames(callee.heard()), "the callee heard nothing of the agent"


async def test_an_extension_registers_over_tls_and_its_calls_come_over_tls(
    llm: ScriptedLLM, tmp_path: Path, certificate: tuple[Path, Path]
) -> None:
    """Kamailio as a PBX on TLS: Vocable registers over TLS (the registrar's certificate
    checked), and a call to the extension reaches it over TLS."""
    cert, key = certificate
    with run_kamailio(tmp_path / "pbx", PBX_CONFIG, {"PASSWORD": "s3cret"}, tls=(cert, key)) as pbx:
        assert pbx.tls_port is not None
        register = RegisterSettings(
            f"sip:agent@127.0.0.1:{pbx.tls_port};transport=tls",
            ("127.0.0.1", pbx.tls_port),
            "agent",
            Secret("s3cret"),
            transport="tls",
            ca_file=cert,
        )
        tls = SipTls("127.0.0.1", free_port(), cert, key)
        sip = SipSettings(host="127.0.0.1", port=0, tls=tls, register=register)
        async with voice_server(llm.base_url, ServerConfig(sip=sip)) as server:
            registrar = server.app[SIP].registrar
            assert registrar is not None
            await until(lambda: registrar.registered, 10, "not registered over TLS")
            assert registrar.describe()["contact"] == f"sip:agent@127.0.0.1:{tls.port}"
            phone = await SipPhone.open(pbx.port)  # a phone on the PBX, over UDP
            try:
                answer = await phone.invite("agent")
                assert answer.status_code == 200, answer
                assert "transport=tls" in (answer.headers.get_first("contact") or "")
                assert (await phone.bye()).status_code == 200
            finally:
                await phone.close()
        log = pbx.log_text()
    assert "REGISTER of sip:agent@" in log, log  # challenged, then taken
