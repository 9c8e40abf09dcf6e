"""The ``estimate`` backend of ``token-producer``: tokenizer-free byte packing (≈4 bytes a token).

The request's text is flattened to bytes and packed four at a time into little-endian uint32
pseudo-token ids: equal text prefixes give equal id prefixes, but the ids never match a model's
tokens. Multimodal items (images, videos, audio) take a run of placeholder ids (their content hash)
whose length estimates the engine's placeholder count: images from their pixel size, videos from
frames x tokens-per-frame (with the ``x-llm-d-video-*`` request headers), audio from its length.
"""

from __future__ import annotations

import base64
import binascii
import struct
import sys
from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
import xxhash

from epp.framework import ApiKind, RequestBody
from epp.framework.params import OMIT_UNSET
from epp.framework.wire import VIDEO_DURATION_HEADER, VIDEO_FPS_HEADER, VIDEO_RESOLUTION_HEADER

BYTES_PER_TOKEN = 4

IMAGE_MODE_DYNAMIC = "dynamic"
IMAGE_MODE_STATIC = "static"
FRAMES_MODE_SAMPLED = "sampled"
FRAMES_MODE_STRIDED = "strided"

DEFAULT_WIDTH = 640
DEFAULT_HEIGHT = 360
DEFAULT_FACTOR = 1024
DEFAULT_VIDEO_DURATION = 10.0  # seconds
DEFAULT_VIDEO_SAMPLE_FPS = 2.0
DEFAULT_VIDEO_SOURCE_FPS = 24.0
_HEADER_PROBE_BYTES = 64 * 1024  # decoded bytes read to find an image's size (JPEG SOF may be late)

MMItem = tuple[str, int, int]  # (content hash, offset in ids, length in ids)


# --- parameters -----------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class Resolution:
    width: int = 0
    height: int = 0

    def validate(self) -> str | None:
        if self.width < 0:
            return f"width: must be non-negative, got {self.width}"
        if self.height < 0:
            return f"height: must be non-negative, got {self.height}"
        return None


def _check_mode(mode: str) -> str | None:
    """The error of a ``mode`` that is neither dynamic nor static (empty: the default)."""
    if mode not in ("", IMAGE_MODE_DYNAMIC, IMAGE_MODE_STATIC):
        return f'mode: must be "{IMAGE_MODE_DYNAMIC}" or "{IMAGE_MODE_STATIC}", got {mode!r}'
    return None


@dataclass(slots=True, frozen=True)
class ImageStatic:
    static_token: int = 0


@dataclass(slots=True, frozen=True)
class DynamicFactor:
    factor: int = 0


def _resolution(res: Resolution | None) -> Resolution:
    """The default resolution used (a size of 0 means the default)."""
    res = res or Resolution()
    return Resolution(
        res.width if res.width > 0 else DEFAULT_WIDTH, res.height if res.height > 0 else DEFAULT_HEIGHT
    )


def _factor(dynamic: DynamicFactor | None) -> DynamicFactor:
    """The pixels-per-token factor used (0 or less means the default)."""
    factor = dynamic.factor if dynamic is not None else 0
    return DynamicFactor(factor if factor > 0 else DEFAULT_FACTOR)


@dataclass(slots=True, frozen=True)
class ImageEstimate:
    mode: str = ""  # "": dynamic
    default_resolution: Resolution | None = None
    static: ImageStatic | None = field(default=None, metadata=OMIT_UNSET)  # the static mode's
    dynamic: DynamicFactor | None = field(default=None, metadata=OMIT_UNSET)  # the dynamic mode's

    def effective(self) -> ImageEstimate:
        """The mode used with its settings and the defaults the estimator applies."""
        res = _resolution(self.default_resolution)
        if self.mode == IMAGE_MODE_STATIC:
            token = self.static.static_token if self.static is not None else 0
            return ImageEstimate(IMAGE_MODE_STATIC, res, ImageStatic(token if token > 0 else 1), None)
        return ImageEstimate(IMAGE_MODE_DYNAMIC, res, None, _factor(self.dynamic))

    def validate(self) -> str | None:
        return _check_mode(self.mode)


@dataclass(slots=True, frozen=True)
class TokensPerFrameStatic:
    num_tokens_per_frame: int = 0


@dataclass(slots=True, frozen=True)
class TokensPerFrame:
    mode: str = ""  # "": dynamic
    static: TokensPerFrameStatic | None = field(default=None, metadata=OMIT_UNSET)  # the static mode's
    dynamic: DynamicFactor | None = field(default=None, metadata=OMIT_UNSET)  # the dynamic mode's

    def effective(self) -> TokensPerFrame:
        """The mode used with its settings and the defaults the estimator applies."""
        if self.mode == IMAGE_MODE_STATIC:
            n = self.static.num_tokens_per_frame if self.static is not None else 0
            return TokensPerFrame(IMAGE_MODE_STATIC, TokensPerFrameStatic(n if n > 0 else 1), None)
        return TokensPerFrame(IMAGE_MODE_DYNAMIC, None, _factor(self.dynamic))

    def validate(self) -> str | None:
        return _check_mode(self.mode)


@dataclass(slots=True, frozen=True)
class FramesSampled:
    sample_fps: float = field(default=0.0, metadata={"key": "sampleFPS"})
    temporal_patch_size: int = 0


@dataclass(slots=True, frozen=True)
class FramesStrided:
    default_source_fps: float = field(default=0.0, metadata={"key": "defaultSourceFPS"})
    frame_stride: int = 0


@dataclass(slots=True, frozen=True)
class Frames:
    mode: str = ""  # "": sampled
    min_frames: int = 0  # 0: no lower bound
    max_frames: int = 0  # 0: no upper bound
    sampled: FramesSampled | None = field(default=None, metadata=OMIT_UNSET)  # the sampled mode's
    strided: FramesStrided | None = field(default=None, metadata=OMIT_UNSET)  # the strided mode's

    def effective(self) -> Frames:
        """The mode used with its settings and the defaults the estimator applies."""
        if self.mode == FRAMES_MODE_STRIDED:
            st = self.strided or FramesStrided()
            fps = st.default_source_fps if st.default_source_fps > 0 else DEFAULT_VIDEO_SOURCE_FPS
            strided = FramesStrided(fps, max(1, st.frame_stride))
            return Frames(FRAMES_MODE_STRIDED, self.min_frames, self.max_frames, None, strided)
        sa = self.sampled or FramesSampled()
        sampled = FramesSampled(
            sa.sample_fps if sa.sample_fps > 0 else DEFAULT_VIDEO_SAMPLE_FPS, sa.temporal_patch_size
        )
        return Frames(FRAMES_MODE_SAMPLED, self.min_frames, self.max_frames, sampled, None)

    def validate(self) -> str | None:
        if self.mode not in ("", FRAMES_MODE_SAMPLED, FRAMES_MODE_STRIDED):
            return f'mode: must be "{FRAMES_MODE_SAMPLED}" or "{FRAMES_MODE_STRIDED}", got {self.mode!r}'
        return None


@dataclass(slots=True, frozen=True)
class VideoEstimate:
    default_resolution: Resolution | None = None
    default_duration: float = 0.0
    tokens_per_frame: TokensPerFrame | None = None
    frames: Frames | None = None
    max_video_tokens: int = 0  # 0: no cap

    def effective(self) -> VideoEstimate:
        """The defaults the estimator applies, written out."""
        duration = self.default_duration if self.default_duration > 0 else DEFAULT_VIDEO_DURATION
        return VideoEstimate(
            _resolution(self.default_resolution),
            duration,
            self.tokens_per_frame or TokensPerFrame(),
            self.frames or Frames(),
            self.max_video_tokens,
        )


@dataclass(slots=True, frozen=True)
class EstimateParams:
    """``estimate``: multimodal placeholder estimation; empty uses the built-in defaults."""

    image: ImageEstimate | None = None
    video: VideoEstimate | None = None

    def effective(self) -> EstimateParams:
        """Both estimates, the built-in defaults written out (``effective()`` of each, in turn)."""
        return EstimateParams(self.image or ImageEstimate(), self.video or VideoEstimate())


# --- placeholder counts ---------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class VideoMeta:
    """Per-request video properties from the ``x-llm-d-video-*`` headers (0: not given)."""

    width: int = 0
    height: int = 0
    duration: float = 0.0
    fps: float = 0.0


_NO_VIDEO_META = VideoMeta()


def _positive_float(value: str | None) -> float:
    if not value:
        return 0.0
    try:
        v = float(value)
    except ValueError:
        return 0.0
    return v if v > 0 and v != float("inf") else 0.0


def parse_resolution(value: str) -> tuple[int, int]:
    """``WIDTHxHEIGHT`` (``x`` or ``X``) as pixels; (0, 0) when empty or malformed."""
    i = min((j for j in (value.find("x"), value.find("X")) if j >= 0), default=-1)
    if i <= 0:
        return 0, 0
    try:
        w, h = int(value[:i].strip()), int(value[i + 1 :].strip())
    except ValueError:
        return 0, 0
    return (w, h) if w > 0 and h > 0 else (0, 0)


def video_meta(headers: Mapping[str, str]) -> VideoMeta:
    """The request's video headers; a missing or malformed value leaves its field 0."""
    duration = headers.get(VIDEO_DURATION_HEADER)
    fps = headers.get(VIDEO_FPS_HEADER)
    res = headers.get(VIDEO_RESOLUTION_HEADER)
    if duration is None and fps is None and res is None:
        return _NO_VIDEO_META
    w, h = parse_resolution(res) if res else (0, 0)
    return VideoMeta(w, h, _positive_float(duration), _positive_float(fps))


class ImageEstimator:
    """Placeholder ids of an image: ``width*height/factor`` (dynamic) or a constant (static), >= 1."""

    __slots__ = ("factor", "height", "static", "static_token", "width")

    def __init__(self, cfg: ImageEstimate | None) -> None:
        cfg = cfg or ImageEstimate()
        res = cfg.default_resolution or Resolution()
        self.static = cfg.mode == IMAGE_MODE_STATIC
        self.static_token = cfg.static.static_token if cfg.static else 0
        self.width = res.width if res.width > 0 else DEFAULT_WIDTH
        self.height = res.height if res.height > 0 else DEFAULT_HEIGHT
        factor = cfg.dynamic.factor if cfg.dynamic else 0
        self.factor = factor if factor > 0 else DEFAULT_FACTOR

    def count(self, size: tuple[int, int] | None) -> int:
        if self.static:
            return self.static_token if self.static_token > 0 else 1
        w, h = size if size is not None else (self.width, self.height)
        return max(1, (w * h) // self.factor)

    def count_url(self, url: str) -> int:
        return self.count(image_size_of_url(url) if not self.static else None)

    def count_base64(self, data: str) -> int:
        return self.count(image_size(_b64_head(data)) if not self.static else None)


class VideoEstimator:
    """Placeholder ids of a video: ``min(frames * tokensPerFrame, maxVideoTokens)``, >= 1."""

    __slots__ = (
        "duration",
        "factor",
        "height",
        "max_frames",
        "max_tokens",
        "min_frames",
        "sample_fps",
        "source_fps",
        "static",
        "static_token",
        "stride",
        "strided",
        "temporal_patch",
        "width",
    )

    def __init__(self, cfg: VideoEstimate | None) -> None:
        cfg = cfg or VideoEstimate()
        tpf = cfg.tokens_per_frame or TokensPerFrame()
        frames = cfg.frames or Frames()
        res = cfg.default_resolution or Resolution()
        self.static = tpf.mode == IMAGE_MODE_STATIC
        self.static_token = tpf.static.num_tokens_per_frame if tpf.static else 0
        self.factor = (tpf.dynamic.factor if tpf.dynamic else 0) or DEFAULT_FACTOR
        if self.factor < 0:
            self.factor = DEFAULT_FACTOR
        self.width, self.height = res.width, res.height
        self.duration = cfg.default_duration if cfg.default_duration > 0 else DEFAULT_VIDEO_DURATION
        self.strided = frames.mode == FRAMES_MODE_STRIDED
        self.min_frames, self.max_frames = frames.min_frames, frames.max_frames
        sampled = frames.sampled or FramesSampled()
        strided = frames.strided or FramesStrided()
        self.sample_fps = sampled.sample_fps if sampled.sample_fps > 0 else DEFAULT_VIDEO_SAMPLE_FPS
        self.temporal_patch = sampled.temporal_patch_size
        self.source_fps = (
            strided.default_source_fps if strided.default_source_fps > 0 else DEFAULT_VIDEO_SOURCE_FPS
        )
        self.stride = max(1, strided.frame_stride)
        self.max_tokens = cfg.max_video_tokens

    def _clamp(self, n: int) -> int:
        if self.min_frames > 0 and n < self.min_frames:
            n = self.min_frames
        if self.max_frames > 0 and n > self.max_frames:
            n = self.max_frames
        return n

    def frames(self, meta: VideoMeta) -> int:
        duration = meta.duration if meta.duration > 0 else self.duration
        if self.strided:
            fps = meta.fps if meta.fps > 0 else self.source_fps
            return self._clamp(int(duration * fps) // self.stride)
        n = self._clamp(int(duration * self.sample_fps))  # the model's sampling rate, never a header
        if self.temporal_patch > 1:
            n //= self.temporal_patch
        return n

    def tokens_per_frame(self, meta: VideoMeta) -> int:
        if self.static:
            return self.static_token if self.static_token > 0 else 1
        if meta.width > 0 and meta.height > 0:
            w, h = meta.width, meta.height
        else:
            w = self.width if self.width > 0 else DEFAULT_WIDTH
            h = self.height if self.height > 0 else DEFAULT_HEIGHT
        return max(1, (w * h) // self.factor)

    def count(self, meta: VideoMeta) -> int:
        tokens = self.frames(meta) * self.tokens_per_frame(meta)
        if self.max_tokens > 0 and tokens > self.max_tokens:
            tokens = self.max_tokens
        return max(1, tokens)


# --- image sizes from their headers ---------------------------------------------------------------


def _b64_head(data: str) -> bytes:
    head = data[: (_HEADER_PROBE_BYTES // 3) * 4]
    try:
        return base64.b64decode(head + "=" * (-len(head) % 4), validate=False)
    except (binascii.Error, ValueError):
        return b""


def image_size_of_url(url: str) -> tuple[int, int] | None:
    """The pixel size of a ``data:image/...;base64,`` URL; None for other URLs or undecodable data."""
    if not url.startswith("data:image/"):
        return None
    i = url.find("base64,")
    if i < 0:
        return None
    return image_size(_b64_head(url[i + 7 :]))


def image_size(head: bytes) -> tuple[int, int] | None:
    """(width, height) from the first bytes of a PNG, GIF or JPEG file; None when not recognised."""
    if head.startswith(b"\x89PNG\r\n\x1a\n") and len(head) >= 24 and head[12:16] == b"IHDR":
        w, h = struct.unpack(">II", head[16:24])
    elif head[:6] in (b"GIF87a", b"GIF89a") and len(head) >= 10:
        w, h = struct.unpack("<HH", head[6:10])
    elif head.startswith(b"\xff\xd8"):
        size = _jpeg_size(head)
        if size is None:
            return None
        w, h = size
    else:
        return None
    return (w, h) if w > 0 and h > 0 else None


_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            i += 2
            continue
        (length,) = struct.unpack(">H", data[i + 2 : i + 4])
        if marker in _JPEG_SOF:
            if i + 9 > n:
                return None
            h, w = struct.unpack(">HH", data[i + 5 : i + 9])
            return w, h
        i += 2 + length
    return None


# --- flattening a request to bytes ----------------------------------------------------------------


class _Stream:
    """The byte stream being built, and the multimodal items placed in it."""

    __slots__ = ("items", "out")

    def __init__(self) -> None:
        self.out = bytearray()
        self.items: list[MMItem] = []

    def text(self, s: Any) -> None:
        if isinstance(s, str) and s:
            self.out += s.encode("utf-8", "surrogatepass")

    def asset(self, content: str, count: int) -> None:
        """Align to a token, then ``count`` copies of the content hash's low 32 bits."""
        out = self.out
        pad = -len(out) % BYTES_PER_TOKEN
        if pad:
            out += b"\0" * pad
        offset = len(out) // BYTES_PER_TOKEN
        h = xxhash.xxh64_intdigest(content.encode("utf-8", "surrogatepass"))
        out += struct.pack("<I", h & 0xFFFFFFFF) * count
        self.items.append((format(h, "x"), offset, count))


def pack(raw: bytes | bytearray) -> array[int]:
    """Little-endian uint32 ids of ``raw`` (zero-padded to a multiple of 4 bytes).

    An ``array('I')``: a sequence of ints without one Python object per id (a list of the 200K ids
    of an 800 KB prompt costs about 9 ms to build, the array 0.1 ms).
    """
    pad = -len(raw) % BYTES_PER_TOKEN
    if pad:
        raw = bytes(raw) + b"\0" * pad
    ids = array("I")
    ids.frombytes(raw)
    if sys.byteorder != "little":
        ids.byteswap()
    return ids


class Estimator:
    """The ``estimate`` backend: ``(ids, multimodal items)`` of a request body."""

    __slots__ = ("image", "video")

    def __init__(self, cfg: EstimateParams | None) -> None:
        cfg = cfg or EstimateParams()
        self.image = ImageEstimator(cfg.image)
        self.video = VideoEstimator(cfg.video)

    def estimate(
        self, body: RequestBody, headers: Mapping[str, str]
    ) -> tuple[array[int], tuple[MMItem, ...]]:
        if body.api is ApiKind.CHAT_COMPLETIONS:
            s = self._chat(body.payload, headers)
        elif body.api is ApiKind.MESSAGES:
            s = self._messages(body.payload)
        else:
            return pack(body.prompt_text.encode("utf-8", "surrogatepass")), ()
        return pack(s.out), tuple(s.items)

    def _chat(self, payload: Mapping[str, Any], headers: Mapping[str, str]) -> _Stream:
        s = _Stream()
        tools = payload.get("tools")
        if tools:
            s.out += orjson.dumps(tools)
        messages = payload.get("messages")
        meta: VideoMeta | None = None
        for msg in messages if isinstance(messages, list) else ():
            if not isinstance(msg, dict):
                continue
            s.text(msg.get("role"))
            content = msg.get("content")
            if isinstance(content, str):
                s.text(content)
                continue
            for block in content if isinstance(content, list) else ():
                if not isinstance(block, dict):
                    continue
                kind = block.get("type")
                if kind == "text":
                    s.text(block.get("text"))
                elif kind == "image_url":
                    url = _url(block.get("image_url"))
                    s.asset(url, self.image.count_url(url))
                elif kind == "video_url":
                    if meta is None:
                        meta = video_meta(headers)
                    s.asset(_url(block.get("video_url")), self.video.count(meta))
                elif kind in ("input_audio", "audio_url"):
                    audio = block.get("input_audio")
                    audio = audio if isinstance(audio, dict) else {}
                    data = _str(audio.get("data")) + _str(audio.get("format"))
                    s.asset(data, max(1, -(-len(data) // BYTES_PER_TOKEN)))
        return s

    def _messages(self, payload: Mapping[str, Any]) -> _Stream:
        s = _Stream()
        tools = payload.get("tools")
        if tools:
            s.out += orjson.dumps(tools)
        s.text(anthropic_system_text(payload.get("system")))
        messages = payload.get("messages")
        for msg in messages if isinstance(messages, list) else ():
            if not isinstance(msg, dict):
                continue
            s.text(msg.get("role"))
            content = msg.get("content")
            if isinstance(content, str):
                s.text(content)
                continue
            for block in content if isinstance(content, list) else ():
                if not isinstance(block, dict):
                    continue
                kind = block.get("type")
                if kind == "text":
                    s.text(block.get("text"))
                elif kind == "image":
                    self._anthropic_image(s, block.get("source"))
                elif kind == "thinking":
                    s.text(block.get("thinking"))
                elif kind == "tool_use":
                    s.text(block.get("id"))
                    s.text(block.get("name"))
                    if "input" in block:
                        s.out += orjson.dumps(block["input"])
                elif kind == "tool_result":
                    text, images = tool_result_content(block)
                    s.text(text)
                    for url in images:
                        s.asset(url, self.image.count_url(url))
        return s

    def _anthropic_image(self, s: _Stream, src: Any) -> None:
        if not isinstance(src, dict):
            return
        url, data = _str(src.get("url")), _str(src.get("data"))
        if url:
            s.asset(url, self.image.count_url(url))
        elif data:
            s.asset(data, self.image.count_base64(data))


def _str(v: Any) -> str:
    return v if isinstance(v, str) else ""


def _url(v: Any) -> str:
    return _str(v.get("url")) if isinstance(v, dict) else _str(v)


BILLING_HEADER_PREFIX = "x-anthropic-billing-header"


def anthropic_system_text(system: Any) -> str:
    """An Anthropic ``system`` as text: a string, or its text blocks concatenated; blocks carrying
    Claude Code's per-request billing header (which vLLM strips) are left out."""
    if isinstance(system, str):
        return system
    if not isinstance(system, list):
        return ""
    return "".join(
        t
        for b in system
        if isinstance(b, dict) and b.get("type") == "text"
        for t in (_str(b.get("text")),)
        if t and not t.startswith(BILLING_HEADER_PREFIX)
    )


def tool_result_content(block: dict[str, Any]) -> tuple[str, list[str]]:
    """A ``tool_result``'s text (text blocks joined by newlines) and its images as URLs."""
    content = block.get("content")
    if isinstance(content, str):
        return content, []
    texts: list[str] = []
    images: list[str] = []
    for item in content if isinstance(content, list) else ():
        if not isinstance(item, dict):
            continue
        if item.get("type") == "text":
            texts.append(_str(item.get("text")))
        elif item.get("type") == "image":
            url = anthropic_image_url(item.get("source"))
            if url:
                images.append(url)
    return "\n".join(texts), images


def anthropic_image_url(src: Any) -> str:
    """An Anthropic image source as a URL: its ``url``, or a ``data:`` URI of its base64 data."""
    if not isinstance(src, dict):
        return ""
    url = _str(src.get("url"))
    if src.get("type") == "url" or url:
        return url
    data = _str(src.get("data"))
    if not data:
        return ""
    return f"data:{_str(src.get('media_type')) or 'image/jpeg'};base64,{data}"
