"""How calls reach a session: WebRTC (aiortc), Twilio/Telnyx media streams, Asterisk AudioSocket,
native SIP, and an in-memory loopback for tests."""
