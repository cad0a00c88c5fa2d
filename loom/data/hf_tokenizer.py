"""A Hugging Face tokenizer behind the interface collation uses (``data.tokenizer = "<dir>"``).

`HFTokenizer` loads a local tokenizer directory with ``AutoTokenizer.from_pretrained(path,
local_files_only=True)`` (nothing is downloaded) and gives what `loom.data.tokenizer.Tokenizer`
gives: ``encode(text)`` with BOS / EOS around the text's ids (each only where the tokenizer has
one), ``token_id``, ``has``, ``vocab_size``, ``pad_id``, ``decode``. The modality markers
(``<image>``, ``<audio>``, and ``extra_tokens`` such as ``<gen_image>``) must be one id each,
since collation expands each marker id into its item's placeholders: markers the tokenizer
lacks are added as special tokens (after its vocabulary, so its own ids stay; the model's
embedding table must then hold ``vocab_size`` ids).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from loom.data.tokenizer import AUDIO_MARKER, IMAGE_MARKER


class HFTokenizer:
    """The Hugging Face tokenizer in the local directory ``path`` (see the module docstring);
    a one-line ``ValueError`` naming the directory when it cannot be loaded."""

    def __init__(self, path: str | Path, extra_tokens: Iterable[str] = ()) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            raise ValueError(f"tokenizer {path}: a Hugging Face tokenizer needs transformers ({e}); "
                             "pip install transformers") from e
        if not Path(path).is_dir():
            raise ValueError(f"tokenizer directory {path} does not exist; point it at a local Hugging Face "
                             "tokenizer (a directory with tokenizer.json / tokenizer_config.json)")
        try:
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"tokenizer directory {path} does not load with AutoTokenizer "
                             f"({' '.join(str(e).split())}); check that it holds a saved tokenizer") from e
        vocab = tok.get_vocab()
        missing = [m for m in dict.fromkeys([IMAGE_MARKER, AUDIO_MARKER, *extra_tokens]) if m not in vocab]
        if missing:  # special: never split, never normalised
            tok.add_tokens(missing, special_tokens=True)
        self.path = Path(path)
        self.hf = tok
        self._vocab = tok.get_vocab()
        for marker in (IMAGE_MARKER, AUDIO_MARKER, *extra_tokens):
            ids = tok.encode(marker, add_special_tokens=False)
            if ids != [self._vocab[marker]]:
                raise ValueError(f"tokenizer directory {path}: {marker!r} encodes to {ids}, not one id; use a "
                                 "tokenizer that keeps it whole (loom adds it as a special token when absent)")

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def bos_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def eos_id(self) -> int | None:
        return self.hf.eos_token_id

    @property
    def pad_id(self) -> int:
        """The tokenizer's pad id, else its EOS, else 0: padding is masked from the loss anyway."""
        for i in (self.hf.pad_token_id, self.hf.eos_token_id):
            if i is not None:
                return int(i)
        return 0

    def token_id(self, token: str) -> int:
        """The id of one token (a marker, or a token of the vocabulary); the unknown id, else
        ``ValueError``, when it has none."""
        i = self._vocab.get(token)
        if i is None:
            if self.hf.unk_token_id is None:
                raise ValueError(f"tokenizer {self.path}: no token {token!r} and no unknown token")
            return int(self.hf.unk_token_id)
        return int(i)

    def has(self, token: str) -> bool:
        return token in self._vocab

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """The ids of ``text``; with ``add_special`` wrapped in BOS ... EOS (each where the
        tokenizer has one)."""
        ids = list(self.hf.encode(text, add_special_tokens=False))
        if add_special:
            ids = ([self.bos_id] if self.bos_id is not None else []) + ids + (
                [self.eos_id] if self.eos_id is not None else [])
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def __len__(self) -> int:
        return self.vocab_size
