"""Deterministic checks: term lists, regexes and PII, each hit a span of the text.

PII: phone numbers through `phonenumbers` (Google's libphonenumber, pure Python, no model),
payment cards as 13-19 digit runs whose Luhn check digit holds (`python-stdnum`'s Luhn), and
email addresses by a documented pattern. NER-based libraries (Presidio, scrubadub's NER
detectors) pull spaCy or Stanford models: a second model to load beside the resident base,
which is what guardrails on the base are meant to avoid (docs/guardrails.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import phonenumbers
from stdnum import luhn

PII_KINDS = ("email", "phone", "card")
REDACTED = "[REDACTED]"

# RFC 5322's common subset: local part, @, dotted domain with a 2+ letter TLD.
EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}")
# 13-19 digits, optionally grouped by single spaces or dashes (as cards are written).
CARD = re.compile(r"(?<!\d)\d(?:[ -]?\d){12,18}(?!\d)")


@dataclass(frozen=True)
class Hit:
    rule: str  # "term", "regex:<i>", "pii:<kind>"
    start: int
    end: int


@dataclass(frozen=True)
class Checks:
    """The deterministic part of one policy, compiled once when the policy is loaded."""

    terms: re.Pattern | None
    patterns: tuple[re.Pattern, ...]
    pii: tuple[str, ...]
    phone_region: str = "US"

    @classmethod
    def build(cls, terms: list[str], patterns: list[str], pii: list[str]) -> Checks:
        terms_re = None
        if terms:
            # Longest first: "foo bar" wins over "foo" at the same place.
            alts = "|".join(re.escape(t) for t in sorted(terms, key=len, reverse=True))
            terms_re = re.compile(alts, re.IGNORECASE)
        return cls(terms_re, tuple(re.compile(p) for p in patterns), tuple(pii))

    @property
    def empty(self) -> bool:
        return self.terms is None and not self.patterns and not self.pii

    def scan(self, text: str) -> list[Hit]:
        hits: list[Hit] = []
        if self.terms is not None:
            hits += [Hit("term", m.start(), m.end()) for m in self.terms.finditer(text)]
        for i, p in enumerate(self.patterns):
            found = (m for m in p.finditer(text) if m.end() > m.start())  # empty matches: none
            hits += [Hit(f"regex:{i}", m.start(), m.end()) for m in found]
        if "email" in self.pii:
            hits += [Hit("pii:email", m.start(), m.end()) for m in EMAIL.finditer(text)]
        if "card" in self.pii:
            hits += [
                Hit("pii:card", m.start(), m.end())
                for m in CARD.finditer(text)
                if luhn.is_valid(re.sub(r"[ -]", "", m.group()))
            ]
        if "phone" in self.pii:
            found = phonenumbers.PhoneNumberMatcher(text, self.phone_region)
            hits += [Hit("pii:phone", m.start, m.end) for m in found]
        return sorted(hits, key=lambda h: (h.start, -h.end))


def check_rules(terms: list[str], patterns: list[str], pii: list[str]) -> str | None:
    """Why a policy's lists are refused (a message for a 400), or None."""
    for i, p in enumerate(patterns):
        try:
            re.compile(p)
        except re.error as e:
            return f"patterns[{i}] is not a valid regular expression: {e}"
    bad = [k for k in pii if k not in PII_KINDS]
    if bad:
        return f"unknown pii kinds {bad}; known: {list(PII_KINDS)}"
    if any(not t for t in terms):
        return "terms must not be empty strings"
    return None


def redact(text: str, spans: list[tuple[int, int]]) -> str:
    """`text` with each span (merged where they overlap) replaced by one marker."""
    out, at = [], 0
    for start, end in merge(spans):
        out += [text[at:start], REDACTED]
        at = end
    out.append(text[at:])
    return "".join(out)


def merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]
