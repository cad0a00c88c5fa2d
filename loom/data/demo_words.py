"""The demo dataset's words: every word its templates can emit, from which the default
`Tokenizer` vocabulary is built (``demo_vocabulary``). Kept apart from `loom.data.demo` because
the demo generator itself counts tokens with a Tokenizer."""

from __future__ import annotations


NUMBER_WORDS: tuple[str, ...] = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
)

# RGB in [0, 1]; saturated so that a colour is recognisable from a single 8x8 patch.
COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (0.92, 0.12, 0.10),
    "green": (0.12, 0.80, 0.15),
    "blue": (0.15, 0.30, 0.95),
    "yellow": (0.95, 0.88, 0.10),
}

SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
SHAPE_CORNERS: dict[str, int] = {"circle": 0, "square": 4, "triangle": 3}

# Pitch word -> frequency in Hz. Far apart (more than an octave) so that a tiny conv encoder
# separates them easily; all well below the Nyquist frequency of the default 8 kHz.
TONES: dict[str, float] = {"low": 300.0, "mid": 700.0, "high": 1500.0}

# The fixed words of the templates, punctuation included (it is space-separated in the text).
TEMPLATE_WORDS: tuple[str, ...] = (
    "a", "and", ",", ":", ".", "shape", "shapes", "tone", "then",
    "plus", "is", "has", "corners", "count", "from",
)


def demo_vocabulary() -> list[str]:
    """Every word the demo generator can emit, deterministic order, no duplicates."""
    words = [*TEMPLATE_WORDS, *NUMBER_WORDS, *COLOURS, *SHAPES, *TONES]
    return list(dict.fromkeys(words))
