"""What telephone lines share, and the lines that are not SIP: AudioSocket and media streams
(Twilio, Telnyx)."""
