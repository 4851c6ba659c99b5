"""Transfers of media-stream calls: the provider's REST API moves the phone call to a person.

A media stream only carries audio; the phone call itself lives at the provider. To put the
caller through, Vocable tells the stream (a ``transfer`` event, which Twilio ignores and a
platform of one's own may act on) and, with ``--transfer-api-url``, updates the live call the
way Twilio's API does it::

    POST {base}/2010-04-01/Accounts/{AccountSid}/Calls/{CallSid}.json
    Authorization: Basic base64(username:password)
    Content-Type: application/x-www-form-urlencoded

    Twiml=<Response><Dial timeout="30"><Sip>sip:desk@pbx</Sip></Dial></Response>

The provider then runs that TwiML instead of the stream (the stream stops). A 2xx answer is a
transfer handed over (``answered``, ``how="provider"``): whether the person picks up is the
provider's business from then on. Any other status, or no answer within the time limit, is a
``refused`` transfer the agent tells the caller about.
"""

from __future__ import annotations

import logging
from xml.sax.saxutils import escape, quoteattr

import aiohttp

from playbooks.transfer import TransferOutcome, TransferRequest
from server.config.server import TransferApiSettings

__all__ = ["call_update_url", "dial_twiml", "transfer_by_api"]

log = logging.getLogger(__name__)


def dial_twiml(request: TransferRequest) -> str:
    """The TwiML that dials ``request.destination``: ``<Sip>`` for a SIP URI, ``<Number>``
    for a phone number; ``timeout`` is the ring time in seconds."""
    destination = request.destination.removeprefix("tel:")
    noun = "Sip" if destination.startswith(("sip:", "sips:")) else "Number"
    timeout = quoteattr(str(max(1, round(request.ring_timeout_s))))
    dial = f"<Dial timeout={timeout}><{noun}>{escape(destination)}</{noun}></Dial>"
    return f"<Response>{dial}</Response>"


def call_update_url(base_url: str, account_sid: str, call_sid: str) -> str:
    """Twilio's URL of one live call."""
    return f"{base_url.rstrip('/')}/2010-04-01/Accounts/{account_sid}/Calls/{call_sid}.json"


async def transfer_by_api(
    http: aiohttp.ClientSession,
    api: TransferApiSettings,
    account_sid: str,
    call_sid: str,
    request: TransferRequest,
) -> TransferOutcome:
    """Ask the provider, through ``http``, to dial the destination in place of the stream;
    never raises but for cancellation."""
    if not account_sid or not call_sid:
        return TransferOutcome.failed(
            "not_supported", "the stream's start named no accountSid and callSid"
        )
    username = api.username or account_sid
    headers = {"Authorization": aiohttp.encode_basic_auth(username, api.password or "")}
    url = call_update_url(api.base_url, account_sid, call_sid)
    timeout = aiohttp.ClientTimeout(total=api.timeout_s)
    try:
        async with http.post(
            url, data={"Twiml": dial_twiml(request)}, headers=headers, timeout=timeout
        ) as response:
            body = await response.text()
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.warning("transfer API %s failed: %r", api.base_url, exc)
        return TransferOutcome.failed("refused", f"the provider's API did not answer: {exc!r}")
    if 200 <= response.status < 300:
        return TransferOutcome("answered", how="provider")
    log.warning("transfer API answered %d: %s", response.status, body[:300])
    return TransferOutcome.failed("refused", f"the provider's API answered {response.status}")
