"""Text <-> token ids and the chat layout (Qwen-style `<|im_start|>role ... <|im_end|>` turns) with one placeholder
run per media item.

Presets have no tokenizer, so they get `ByteTokenizer`: ids 0..2 are pad/bos/eos, 3..258 the UTF-8 bytes, then
the special tokens. A model directory with a `tokenizer.json` uses it (the `tokenizers` package); its special
tokens are looked up by name (`<|im_start|>`, `<|image_pad|>`, ...) and a missing one is an error at load time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

SPECIALS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
            "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>", "<|endoftext|>")
PAD_TOKEN = {"image": "<|image_pad|>", "video": "<|video_pad|>", "audio": "<|audio_pad|>"}
OPEN_CLOSE = {"image": ("<|vision_start|>", "<|vision_end|>"), "video": ("<|vision_start|>", "<|vision_end|>"),
              "audio": ("<|audio_start|>", "<|audio_end|>")}


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def special(self, name: str) -> int: ...

    @property
    def eos_ids(self) -> tuple[int, ...]: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens (offset 3) plus `SPECIALS`; vocabulary 3 + 256 + len(SPECIALS)."""

    BYTE_OFFSET = 3
    EOS = 2

    def __init__(self, vocab_size: int) -> None:
        need = self.BYTE_OFFSET + 256 + len(SPECIALS)
        if vocab_size < need:
            raise ValueError(f"the byte tokenizer needs a vocabulary of >= {need} tokens, the model has {vocab_size}")
        self._special = {name: self.BYTE_OFFSET + 256 + i for i, name in enumerate(SPECIALS)}
        self._names = {i: name for name, i in self._special.items()}

    def encode(self, text: str) -> list[int]:
        return [b + self.BYTE_OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        raw = bytes(i - self.BYTE_OFFSET for i in ids if self.BYTE_OFFSET <= i < self.BYTE_OFFSET + 256)
        return raw.decode("utf-8", errors="replace")

    def special(self, name: str) -> int:
        return self._special[name]

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return (self.EOS, self._special["<|im_end|>"])


class HFTokenizer:
    """A `tokenizers.Tokenizer` from a model directory's tokenizer.json."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self._tok = _Tokenizer.from_file(str(path))
        missing = [s for s in SPECIALS[:6] if self._tok.token_to_id(s) is None]
        if missing:
            raise ValueError(f"{path}: the tokenizer lacks the special tokens {missing}")

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def special(self, name: str) -> int:
        token = self._tok.token_to_id(name)
        if token is None:
            raise ValueError(f"the tokenizer has no {name} token")
        return token

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return tuple(i for i in (self._tok.token_to_id("<|im_end|>"), self._tok.token_to_id("<|endoftext|>"))
                     if i is not None)


def load_chat_tokenizer(model: str, vocab_size: int) -> Tokenizer:
    """The directory's tokenizer.json when it has one, else the byte tokenizer."""
    path = Path(model) / "tokenizer.json"
    return HFTokenizer(path) if path.is_file() else ByteTokenizer(vocab_size)


@dataclass(frozen=True)
class MediaRun:
    """A placeholder run in a rendered prompt: positions start..start+length-1 take item `item`'s embedding."""

    item: int
    start: int
    length: int


@dataclass(frozen=True)
class Turn:
    """One chat message: `role` and its content as text pieces and media references (item indices)."""

    role: str
    parts: tuple[str | int, ...]


def render_chat(turns: list[Turn], num_tokens: dict[int, int], modality: dict[int, str], tok: Tokenizer,
                add_generation_prompt: bool = True) -> tuple[list[int], list[MediaRun]]:
    """Token ids of the conversation with one run of `num_tokens[item]` pad tokens per media item.

    Layout per turn: `<|im_start|>{role}\\n{content}<|im_end|>\\n`, media as `<|vision_start|>` + pads +
    `<|vision_end|>` (audio: `<|audio_start|>`...); then `<|im_start|>assistant\\n` when asked.
    """
    ids: list[int] = []
    runs: list[MediaRun] = []
    for turn in turns:
        ids += [tok.special("<|im_start|>"), *tok.encode(f"{turn.role}\n")]
        for part in turn.parts:
            if isinstance(part, str):
                ids += tok.encode(part)
                continue
            kind = modality[part]
            opening, closing = OPEN_CLOSE[kind]
            ids.append(tok.special(opening))
            runs.append(MediaRun(part, len(ids), num_tokens[part]))
            ids += [tok.special(PAD_TOKEN[kind])] * num_tokens[part]
            ids.append(tok.special(closing))
        ids += [tok.special("<|im_end|>"), *tok.encode("\n")]
    if add_generation_prompt:
        ids += [tok.special("<|im_start|>"), *tok.encode("assistant\n")]
    return ids, runs
