"""A word-level tokenizer with a closed vocabulary.

The demo dataset (``loom.data.demo``) only ever produces words from a small set of templates,
so a tokenizer that maps whole words to ids is exact: no word is ever split, every token a
model predicts is a word a person can read, and ``text_tokens`` in a sample's metadata is just
the word count plus BOS/EOS. That keeps the demo learnable by a tiny LLM in minutes.

Ids are stable: the specials come first in a fixed order (``<pad>`` is 0), then the words in
the order the vocabulary lists them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from loom.data.demo_words import demo_vocabulary

PAD = "<pad>"
BOS = "<bos>"
EOS = "<eos>"
UNK = "<unk>"
IMAGE_MARKER = "<image>"
AUDIO_MARKER = "<audio>"
GEN_IMAGE_MARKER = "<gen_image>"  # a generation request for the "image" generator (loom.data.collate)

# Order fixes the ids: <pad>=0, <bos>=1, <eos>=2, <unk>=3, <image>=4, <audio>=5.
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK, IMAGE_MARKER, AUDIO_MARKER)


class Tokenizer:
    """Lowercase, split on whitespace, look each word up; unknown words become ``<unk>``.

    ``words`` is the vocabulary after the specials; by default every word the demo generator
    can produce (``loom.data.demo_words.demo_vocabulary()``), in the generator's deterministic order.
    ``extra_tokens`` (e.g. ``GEN_IMAGE_MARKER`` for a model with an image generator) come after
    the words, so the ids of everything else stay as they are.
    """

    def __init__(self, words: Iterable[str] | None = None, extra_tokens: Iterable[str] = ()) -> None:
        if words is None:
            words = demo_vocabulary()
        self._tokens: list[str] = list(SPECIAL_TOKENS)
        self._ids: dict[str, int] = {tok: i for i, tok in enumerate(self._tokens)}
        for word in [*words, *extra_tokens]:
            word = word.lower()
            if not word or any(ch.isspace() for ch in word):
                raise ValueError(
                    f"Tokenizer words: {word!r} is not a single whitespace-free word; "
                    "pass words as the generator splits them"
                )
            if word not in self._ids:  # duplicates keep their first id
                self._ids[word] = len(self._tokens)
                self._tokens.append(word)

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def pad_id(self) -> int:
        return self._ids[PAD]

    @property
    def bos_id(self) -> int:
        return self._ids[BOS]

    @property
    def eos_id(self) -> int:
        return self._ids[EOS]

    @property
    def unk_id(self) -> int:
        return self._ids[UNK]

    @property
    def tokens(self) -> list[str]:
        """The vocabulary, indexed by id."""
        return list(self._tokens)

    def token_id(self, token: str) -> int:
        """The id of one token (a word or a special such as ``"<image>"``); ``<unk>`` if absent."""
        return self._ids.get(token.lower(), self.unk_id)

    def has(self, token: str) -> bool:
        return token.lower() in self._ids

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Ids of the whitespace-separated, lowercased words of ``text``.

        With ``add_special`` the ids are wrapped in ``<bos>`` ... ``<eos>``. Modality markers
        (``<image>``, ``<audio>``) are ordinary words here: one id each, expanded later by
        ``loom.data.collate.collate``.
        """
        unk = self.unk_id
        ids = [self._ids.get(word, unk) for word in text.lower().split()]
        if add_special:
            ids = [self.bos_id, *ids, self.eos_id]
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Words of ``ids`` joined by single spaces.

        ``skip_special`` drops ``<pad>``, ``<bos>`` and ``<eos>`` (markers and ``<unk>`` stay,
        because they carry meaning). Ids outside the vocabulary raise ``ValueError``.
        """
        skipped = {self.pad_id, self.bos_id, self.eos_id} if skip_special else set()
        words = []
        for i in ids:
            i = int(i)
            if not 0 <= i < len(self._tokens):
                raise ValueError(
                    f"decode: id {i} is outside the vocabulary [0, {len(self._tokens)}); "
                    "decode only ids this tokenizer produced"
                )
            if i not in skipped:
                words.append(self._tokens[i])
        return " ".join(words)

    def __len__(self) -> int:
        return self.vocab_size
