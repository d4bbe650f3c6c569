"""A client of the server's WebSocket session (`/v1/audio/speech/ws`), as a carrier bridge uses it.

A bridge needs audio tagged with the turn it belongs to, so that after a barge-in it can drop the
bytes of cancelled turns that were already in flight: the session is opened with
`audio_framing: "msgpack"`, while control messages stay JSON text frames.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import AsyncIterator, Optional, Union
from urllib.parse import urlsplit, urlunsplit

import msgpack
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

WS_PATH = "/v1/audio/speech/ws"


@dataclass(frozen=True)
class Audio:
    """Encoded audio bytes of one turn, in the format the session asked for."""
    turn_id: str
    data: bytes


def speech_ws_url(url: str) -> str:
    """Accepts the server's base URL (http/https/ws/wss) or the full socket URL."""
    parts = urlsplit(url)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    if scheme not in ("ws", "wss"):
        raise ValueError(f"not a server URL: {url!r}")
    path = parts.path if parts.path not in ("", "/") else WS_PATH
    return urlunsplit((scheme, parts.netloc, path, parts.query, ""))


class TTSClient:
    """One session: say text in turns, cancel, and read audio and control events in order."""

    def __init__(self, ws: ClientConnection, created: dict):
        self.ws = ws
        self.created = created

    @classmethod
    async def open(cls, url: str, *, api_key: Optional[str] = None, encoding: str, sample_rate: int,
                   frame_ms: Optional[int] = None, voice: Optional[str] = None,
                   language: Optional[str] = None, open_timeout: float = 10.0) -> "TTSClient":
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        ws = await connect(speech_ws_url(url), additional_headers=headers, proxy=None,
                           open_timeout=open_timeout, max_size=None)
        try:
            created = json.loads(await asyncio.wait_for(ws.recv(), open_timeout))
            if created.get("type") != "session.created":
                raise ConnectionError(f"TTS server did not open a session: {created}")
            update = {"type": "session.update", "audio_framing": "msgpack",
                      "format": {"encoding": encoding, "sample_rate": sample_rate}}
            if frame_ms:
                update["format"]["frame_ms"] = frame_ms
            if voice:
                update["voice"] = voice
            if language:
                update["language"] = language
            await ws.send(json.dumps(update))
        except BaseException:
            await ws.close()
            raise
        return cls(ws, created)

    async def say(self, turn_id: str, text: str, final: bool = True) -> None:
        await self.ws.send(json.dumps({"type": "text", "turn_id": turn_id, "text": text, "final": final}))

    async def cancel(self, turn_id: Optional[str] = None) -> None:
        msg = {"type": "cancel"}
        if turn_id is not None:
            msg["turn_id"] = turn_id
        await self.ws.send(json.dumps(msg))

    async def ping(self) -> None:
        await self.ws.send(json.dumps({"type": "ping"}))

    async def events(self) -> AsyncIterator[Union[Audio, dict]]:
        """Audio and control messages (dicts) until the server closes the session."""
        try:
            async for frame in self.ws:
                if isinstance(frame, bytes):
                    msg = msgpack.unpackb(frame)
                    if msg.get("type") == "audio":
                        yield Audio(str(msg["turn_id"]), bytes(msg["data"]))
                    else:
                        yield msg
                else:
                    msg = json.loads(frame)
                    if msg.get("type") != "pong":
                        yield msg
        except ConnectionClosed:
            return

    async def close(self) -> None:
        await self.ws.close()
