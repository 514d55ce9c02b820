"""Workplace verification: compare the office's final state with the expected one.

The task's data carries an ``Expect``: the emails that must have been sent, the calendar
changes, and for questions the answer. Reward is 1.0 only when all three hold, else 0.0 (as in
tau-bench, partial progress earns nothing, so side effects cannot be traded for credit):

- ``emails``: the emails sent during the episode match the expected ones one to one: the same
  recipients (``to`` and ``cc`` as sets), the subject (exact, ignoring case and blanks, or
  containing a given text) and every required phrase in the body. Any extra email fails.
- ``events``: the final calendar equals the initial one with the expected changes applied,
  compared by (title, day, start, end, attendees other than the user); ids do not matter, so
  deleting and re-creating an event is as good as updating it.
- ``answer``: the final message contains the expected value and no other number (so listing
  every phone in the directory earns nothing), and the value was shown to the agent by a tool
  (its record id is in ``state.seen``): a right guess is not an answer.
"""

from __future__ import annotations

import re

import msgspec

from streamrl.verifiers.verdict import Verdict
from streamrl.verifiers.workplace_state import Email, Event, WorkplaceState


class EmailSpec(msgspec.Struct, kw_only=True):
    to: list[str]
    cc: list[str] = []
    subject: str | None = None
    subject_contains: str | None = None
    body_contains: list[str] = []


class EventSpec(msgspec.Struct, kw_only=True):
    title: str
    day: str
    start: str
    end: str
    attendees: list[str] = []


class EventChanges(msgspec.Struct, kw_only=True):
    add: list[EventSpec] = []
    remove: list[str] = []  # event ids
    update: dict[str, dict[str, str]] = {}  # event id -> changed fields


class AnswerSpec(msgspec.Struct, kw_only=True):
    kind: str  # "phone" (compared by its last 7 digits) or "code" (a whole number)
    value: str
    grounded: str  # the id of the record a tool must have shown


class Expect(msgspec.Struct, kw_only=True):
    emails: list[EmailSpec] = []
    events: EventChanges = msgspec.field(default_factory=EventChanges)
    answer: AnswerSpec | None = None


def _words(s: str) -> str:
    return " ".join(s.lower().split())


def _email_matches(email: Email, spec: EmailSpec) -> bool:
    subject, body = _words(email.subject), _words(email.body)
    return (
        {a.lower() for a in email.to} == {a.lower() for a in spec.to}
        and {a.lower() for a in email.cc} == {a.lower() for a in spec.cc}
        and (spec.subject is None or subject == _words(spec.subject))
        and (spec.subject_contains is None or _words(spec.subject_contains) in subject)
        and all(_words(p) in body for p in spec.body_contains)
    )


def _event_key(e: Event | EventSpec, me: str) -> tuple:
    people = tuple(sorted({a.lower() for a in e.attendees} - {me.lower()}))
    return (_words(e.title), e.day, e.start, e.end, people)


def _expected_calendar(initial: WorkplaceState, changes: EventChanges) -> list[tuple]:
    keys = []
    for event in initial.events:
        if event.id in changes.remove:
            continue
        if event.id in changes.update:
            event = msgspec.structs.replace(event, **changes.update[event.id])
        keys.append(_event_key(event, initial.me))
    keys += [_event_key(spec, initial.me) for spec in changes.add]
    return sorted(keys)


def _answer_ok(text: str, spec: AnswerSpec, seen: list[str]) -> bool:
    """The text names the value and no other number; the value's record was shown."""
    want = re.sub(r"\D", "", spec.value)
    if spec.kind == "phone":  # join digit groups: "+1 (555) 014-2" -> "15550142"
        text = re.sub(r"(?<=\d)[\s().+-]+(?=\d)", "", text)
    numbers = re.findall(r"\d+", text)
    if spec.kind == "phone":
        fits = [want.endswith(n) and len(n) >= 7 for n in numbers]
    else:
        fits = [n == want for n in numbers]
    return bool(fits) and all(fits) and spec.grounded in seen


def check(initial: WorkplaceState, final: WorkplaceState, expect: Expect, text: str) -> Verdict:
    """The workplace reward (see the module docstring)."""
    sent = final.sent[len(initial.sent) :]
    unmatched = list(sent)
    emails_ok = len(sent) == len(expect.emails)
    for spec in expect.emails:
        hit = next((e for e in unmatched if _email_matches(e, spec)), None)
        if hit is None:
            emails_ok = False
        else:
            unmatched.remove(hit)
    calendar = sorted(_event_key(e, final.me) for e in final.events)
    events_ok = calendar == _expected_calendar(initial, expect.events)
    answered = expect.answer is None or _answer_ok(text, expect.answer, final.seen)
    reward = float(emails_ok and events_ok and answered)
    return Verdict(
        reward=reward,
        components={
            "emails": float(emails_ok),
            "events": float(events_ok),
            "answer": float(answered),
        },
        details={
            "sent": f"{len(sent)} sent, {len(expect.emails)} expected",
            "unexpected": "; ".join(f"{e.to} {e.subject!r}" for e in unmatched)[:200],
        },
    )
