"""The native SIP endpoint: calls in and out, RFC 3261 checks, transfers, RTP ports."""
