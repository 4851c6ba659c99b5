"""Tools that test a Vocable server from the outside, as a caller and an LLM would.

- :mod:`server.testkit.scripted_llm`: an OpenAI-compatible chat-completions server that answers
  from a script (streamed text, tool calls, errors), for deterministic runs of a playbook.
- :mod:`server.testkit.caller`: a WebRTC caller (aiortc) that speaks PCM into a call, records
  what the agent says with arrival times, and reads the call's events.
- :mod:`server.testkit.sip_phone`: a scriptable SIP phone (hand-written SIP over UDP, G.711 RTP,
  RFC 4733 digits) that records what it hears, learns its call's session id from the answer's
  ``X-Vocable-Session`` header and reads the call's events from ``GET /calls/{id}/events``.
- :mod:`server.testkit.loopback`: serve an aiohttp app on a free 127.0.0.1 port.
- :mod:`server.testkit.scenarios`: spoken scenario tests of playbooks (``vocable test``).

Vocable's own tests and its benchmark harness use them; so can a project testing its playbooks.
Only the ``vocable test`` command (``server/commands/test.py``) imports this package; nothing the
server runs on does.
"""
