"""A Hugging Face tokenizer behind the interface collation uses (``data.tokenizer = "<dir>"``).

`HFTokenizer` loads a local tokenizer directory with ``AutoTokenizer.from_pretrained(path,
local_files_only=True)`` (nothing is downloaded) and gives what `loom.data.tokenizer.Tokenizer`
gives: ``encode(text)`` with BOS / EOS around the text's ids (each only where the tokenizer has
one), ``token_id``, ``has``, ``vocab_size``, ``pad_id``, ``decode``. The modality markers
(``<image>``, ``<audio>``, and ``extra_tokens`` such as ``<gen_image>``) must be one id each,
since collation expands each marker id into its item's placeholders: markers the tokenizer
lacks are added as special tokens (after its vocabulary, so its own ids stay; the model's
embedding table must then hold ``vocab_size`` ids).

With ``chat`` (``data.chat_template``) a record's conversation is rendered with the tokenizer's
chat template (`render_chat`), which places its own special tokens, so `encode` adds none; the
assistant turns' character spans (each from after the template's generation prompt through its
end-of-turn text) become the sample's `Sample.target_spans`: the loss covers them only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from loom.data.tokenizer import AUDIO_MARKER, IMAGE_MARKER


class HFTokenizer:
    """The Hugging Face tokenizer in the local directory ``path`` (see the module docstring);
    a one-line ``ValueError`` naming the directory when it cannot be loaded."""

    def __init__(self, path: str | Path, extra_tokens: Iterable[str] = (), chat: bool = False) -> None:
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
        if chat and not getattr(tok, "chat_template", None):
            raise ValueError(f"tokenizer directory {path} has no chat template; use a tokenizer with one, or set "
                             "data.chat_template = false")
        self.path = Path(path)
        self.hf = tok
        self.chat = chat
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
        tokenizer has one; never with ``chat``, whose template renders its own)."""
        return self.encode_offsets(text, add_special)[0]

    def encode_offsets(self, text: str, add_special: bool = True) -> tuple[list[int], list[int]]:
        """`encode`'s ids and each one's first character in ``text`` (-1 for BOS, ``len(text)``
        for EOS: inside no span)."""
        try:
            enc = self.hf(text, add_special_tokens=False, return_offsets_mapping=True)
        except NotImplementedError as e:
            raise ValueError(f"tokenizer {self.path}: character offsets need a fast tokenizer "
                             f"(tokenizer.json); {e}") from e
        ids, starts = list(enc["input_ids"]), [int(a) for a, _ in enc["offset_mapping"]]
        if add_special and not self.chat:
            if self.bos_id is not None:
                ids, starts = [self.bos_id, *ids], [-1, *starts]
            if self.eos_id is not None:
                ids, starts = [*ids, self.eos_id], [*starts, len(text)]
        return ids, starts

    def render_chat(self, turns: Sequence[tuple[str, str]]) -> tuple[str, tuple[tuple[int, int], ...]]:
        """``turns`` (``(role, content)``, roles ``user`` / ``assistant`` / ``system``) rendered with
        the chat template, and the character spans of the assistant turns. A ``ValueError`` when
        the template does not render the conversation's beginnings as prefixes of the whole (the
        spans would be wrong)."""
        messages = [{"role": role, "content": content} for role, content in turns]

        def render(upto: int, prompt: bool = False) -> str:
            return self.hf.apply_chat_template(messages[:upto], tokenize=False, add_generation_prompt=prompt)

        text = render(len(messages))
        spans = []
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before, through = (render(k, prompt=True) if k else ""), render(k + 1)
            if not (text.startswith(through) and through.startswith(before)):
                raise ValueError(f"the chat template of {self.path} does not render turn {k}'s beginning as a prefix "
                                 "of the whole conversation, so its assistant turns cannot be found; use a template "
                                 "that renders turns in order, or set data.chat_template = false")
            spans.append((len(before), len(through)))
        return text, tuple(spans)

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def __len__(self) -> int:
        return self.vocab_size
