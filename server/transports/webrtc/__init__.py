"""Browser calls: WebRTC peers (aiortc), their tracks and the caller's Opus audio."""
