"""One call, whatever carries it: the session (caller frames -> VAD -> turns, barge-in; its
``Phase`` and one ``Answer`` handle per answer), the voice orchestrator (transcript -> playbook
-> sentences -> speech), end-of-turn decisions, the turn's latency timeline, the events clients
see, and the call's clock.

Nothing here imports aiohttp, aiortc or a SIP stack: transports feed a :class:`Session` 16 kHz
frames and pull the agent's audio from its speaker.
"""
