"""The builtin task registry: every task of the suites `builtin-30` and `builtin-8`, what its labels
mean, how it is built and from which pool, its sources and license (`BUILTIN_TASKS`, `SUITES`).

A task is metadata and a recipe: `BuiltinTask.pool` names the pool in `builtin_pools.POOLS` its
texts come from and `axis` which element of a cell is its label; building and caching the datasets
is `builtin`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_fedtask.data.builtin_pools import (
    FAKER,
    KAOMOJI,
    LANGUAGE_FAMILIES,
    MAX_KAOMOJI_CHARS,
    VADER,
    WORDFREQ,
    WORDFREQ_LANGS,
    Source,
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
