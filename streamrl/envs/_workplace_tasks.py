"""The workplace world generator and task templates.

``build_world(seed)`` is a pure function of the seed (the verifier rebuilds the initial state
from it). Each template picks its details from the generator's rng and returns the prompt, the
``Expect`` the verifier checks, a reference plan and a wrong plan (a plausible mistake) for the
audit. A plan is ``{"calls": [[tool, args], ...], "final": text}``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import msgspec

from streamrl.envs.base import Prompt, user
from streamrl.schema import Message
from streamrl.verifiers.workplace import AnswerSpec, EmailSpec, EventChanges, EventSpec, Expect
from streamrl.verifiers.workplace_state import Contact, WorkplaceState

ME_NAME, ME = "Sam Rivera", "sam.rivera@acme.test"
TODAY = "2025-03-03"
PAST_DAYS = ["2025-02-26", "2025-02-27", "2025-02-28"]
DAYS = ["2025-03-03", "2025-03-04", "2025-03-05", "2025-03-06", "2025-03-07"]
FIRST = [
    "Alice",
    "Bruno",
    "Chen",
    "Dana",
    "Elif",
    "Farah",
    "Goran",
    "Hana",
    "Ivan",
    "Jade",
    "Kofi",
    "Lucia",
    "Mateo",
    "Nadia",
]
LAST = [
    "Abbott",
    "Baker",
    "Costa",
    "Diaz",
    "Evans",
    "Fischer",
    "Garcia",
    "Haddad",
    "Ito",
    "Jensen",
    "Kim",
    "Lopez",
    "Moreau",
]
TEAMS = [("Sales", 3), ("Engineering", 4), ("Design", 2), ("Finance", 2)]
SUBJECTS = [
    "Q2 budget",
    "Offsite venue",
    "Hiring plan",
    "Customer escalation",
    "Release notes",
    "Security review",
    "Travel booking",
    "Invoice 1142",
    "Roadmap draft",
    "Quarterly numbers",
    "Laptop refresh",
    "Office move",
]
EVENTS = [
    "Team sync",
    "Design review",
    "1:1",
    "Sprint planning",
    "Budget check-in",
    "Customer call",
    "Interview loop",
    "Retro",
]
NEW_EVENTS = ["Launch prep", "Pricing workshop", "Vendor demo", "Onboarding chat"]
PHRASES = [
    "the deadline is Friday",
    "the numbers look good",
    "please send the slides",
    "let's meet next week",
    "thanks for the quick turnaround",
]

SYSTEM = (
    f"You are the assistant of {ME_NAME} ({ME}) at Acme. Today is {TODAY}. Use the tools to "
    "act on their behalf. When you are done, reply with a short plain-text message."
)

Plan = dict[str, Any]
Made = tuple[str, Expect, Plan, Plan]


def build_world(seed: int) -> dict[str, Any]:
    """The initial office as builtins (converted to ``WorkplaceState`` by the environment)."""
    rng = random.Random(seed)
    n = 1 + sum(size for _, size in TEAMS)
    names = [f"{f} {la}" for f, la in zip(rng.sample(FIRST, n), rng.sample(LAST, n), strict=True)]
    phones = [f"+1-555-0{p}" for p in rng.sample(range(100, 1000), n)]
    contacts = [{"id": "c1", "team": "Leadership", "title": "Director", "manager": ""}]
    for team, size in TEAMS:
        lead = f"c{len(contacts) + 1}"
        contacts.append({"id": lead, "team": team, "title": f"Head of {team}", "manager": "c1"})
        for _ in range(size - 1):
            contacts.append(
                {
                    "id": f"c{len(contacts) + 1}",
                    "team": team,
                    "title": f"{team} specialist",
                    "manager": lead,
                }
            )
    for c, name, phone in zip(contacts, names, phones, strict=True):
        c.update(name=name, phone=phone, email=f"{name.lower().replace(' ', '.')}@acme.test")
    senders = rng.sample(contacts, 8)
    codes = rng.sample(range(2000, 10000), 8)  # four digits, none a small number
    inbox = [
        {
            "id": f"m{i + 1}",
            "sender": c["email"],
            "to": [ME],
            "subject": subject,
            "day": rng.choice(PAST_DAYS),
            "body": f"Hi Sam,\n\nAbout {subject.lower()}: "
            f"{rng.choice(PHRASES)}. The reference code is {code}.\n\n{c['name'].split()[0]}",
        }
        for i, (c, subject, code) in enumerate(
            zip(senders, rng.sample(SUBJECTS, 8), codes, strict=True)
        )
    ]
    events = []
    for i, title in enumerate(rng.sample(EVENTS, 6)):
        hour, half = rng.randint(9, 16), rng.choice([0, 30])
        length = rng.choice([30, 60])
        end = hour * 60 + half + length
        people = [c["email"] for c in rng.sample(contacts, rng.randint(1, 3))]
        events.append(
            {
                "id": f"ev{i + 1}",
                "title": title,
                "day": rng.choice(DAYS),
                "start": f"{hour:02d}:{half:02d}",
                "end": f"{end // 60:02d}:{end % 60:02d}",
                "attendees": people,
            }
        )
    return {"me": ME, "contacts": contacts, "inbox": inbox, "events": events, "next_id": 1}


def _plan(calls: list[tuple[str, dict[str, Any]]], final: str = "Done.") -> Plan:
    return {"calls": [[tool, args] for tool, args in calls], "final": final}


def _others(rng: random.Random, world: WorkplaceState, *not_these: Contact) -> Contact:
    return rng.choice([c for c in world.contacts if c not in not_these])


def _by_id(world: WorkplaceState, cid: str) -> Contact:
    return next(c for c in world.contacts if c.id == cid)


def email_contact(rng: random.Random, world: WorkplaceState) -> Made:
    who = rng.choice(world.contacts)
    other = _others(rng, world, who)
    subject, phrase = rng.choice(NEW_EVENTS) + " notes", rng.choice(PHRASES)
    text = f'Send an email to {who.name} with the subject "{subject}" that says {phrase}.'
    expect = Expect(emails=[EmailSpec(to=[who.email], subject=subject, body_contains=[phrase])])
    send = {"subject": subject, "body": f"Hi {who.name.split()[0]}, {phrase}."}
    plan = _plan(
        [("search_contacts", {"query": who.name}), ("send_email", {"to": [who.email], **send})]
    )
    wrong = _plan(
        [("search_contacts", {"query": who.name}), ("send_email", {"to": [other.email], **send})]
    )
    return text, expect, plan, wrong


def email_team(rng: random.Random, world: WorkplaceState) -> Made:
    team = rng.choice([t for t, _ in TEAMS])
    members = [c.email for c in world.contacts if c.team == team]
    subject, phrase = rng.choice(SUBJECTS), rng.choice(PHRASES)
    text = (
        f'Send one email to everyone on the {team} team with the subject "{subject}" '
        f"saying {phrase}."
    )
    expect = Expect(emails=[EmailSpec(to=members, subject=subject, body_contains=[phrase])])
    send = {"subject": subject, "body": f"Hi all, {phrase}."}
    search = ("search_contacts", {"query": team})
    plan = _plan([search, ("send_email", {"to": members, **send})])
    wrong = _plan([search, ("send_email", {"to": members[:-1], **send})])
    return text, expect, plan, wrong


def email_manager(rng: random.Random, world: WorkplaceState) -> Made:
    who = rng.choice([c for c in world.contacts if c.manager])
    boss = _by_id(world, who.manager)
    subject, phrase = "Quick question", rng.choice(PHRASES)
    text = f'Email {who.name}\'s manager with the subject "{subject}" and tell them {phrase}.'
    expect = Expect(emails=[EmailSpec(to=[boss.email], subject=subject, body_contains=[phrase])])
    send = {"subject": subject, "body": f"Hello, {phrase}."}
    lookups = [("search_contacts", {"query": who.name}), ("search_contacts", {"query": boss.name})]
    plan = _plan([*lookups, ("send_email", {"to": [boss.email], **send})])
    wrong = _plan([*lookups, ("send_email", {"to": [who.email], **send})])
    return text, expect, plan, wrong


def email_cc(rng: random.Random, world: WorkplaceState) -> Made:
    a, b = rng.sample(world.contacts, 2)
    subject, phrase = rng.choice(SUBJECTS), rng.choice(PHRASES)
    text = f'Email {a.name} (and cc {b.name}) with the subject "{subject}" saying {phrase}.'
    spec = EmailSpec(to=[a.email], cc=[b.email], subject=subject, body_contains=[phrase])
    send = {"subject": subject, "body": f"Hi, {phrase}."}
    lookups = [("search_contacts", {"query": a.name}), ("search_contacts", {"query": b.name})]
    plan = _plan([*lookups, ("send_email", {"to": [a.email], "cc": [b.email], **send})])
    wrong = _plan([*lookups, ("send_email", {"to": [a.email, b.email], **send})])
    return text, Expect(emails=[spec]), plan, wrong


def reply(rng: random.Random, world: WorkplaceState) -> Made:
    mail, other = rng.sample(world.inbox, 2)
    sender = next(c for c in world.contacts if c.email == mail.sender)
    phrase = rng.choice(PHRASES)
    text = f'Reply to {sender.name}\'s email about "{mail.subject}" and say {phrase}.'
    spec = EmailSpec(to=[mail.sender], subject_contains=mail.subject, body_contains=[phrase])
    body = {"body": f"Thanks, {phrase}."}
    plan = _plan([("list_emails", {}), ("reply_email", {"email_id": mail.id, **body})])
    wrong = _plan([("list_emails", {}), ("reply_email", {"email_id": other.id, **body})])
    return text, Expect(emails=[spec]), plan, wrong


def forward(rng: random.Random, world: WorkplaceState) -> Made:
    mail = rng.choice(world.inbox)
    who = _others(rng, world, *(c for c in world.contacts if c.email == mail.sender))
    other = _others(rng, world, who)
    text = f'Forward the email with the subject "{mail.subject}" to {who.name}.'
    code_line = mail.body.split("\n\n")[1]
    spec = EmailSpec(to=[who.email], subject_contains=mail.subject, body_contains=[code_line])
    lookups = [("list_emails", {}), ("search_contacts", {"query": who.name})]
    plan = _plan([*lookups, ("forward_email", {"email_id": mail.id, "to": [who.email]})])
    wrong = _plan([*lookups, ("forward_email", {"email_id": mail.id, "to": [other.email]})])
    return text, Expect(emails=[spec]), plan, wrong


def create_event(rng: random.Random, world: WorkplaceState) -> Made:
    title, day = rng.choice(NEW_EVENTS), rng.choice(DAYS)
    hour = rng.randint(9, 16)
    start, end = f"{hour:02d}:00", f"{hour + 1:02d}:00"
    a, b = rng.sample(world.contacts, 2)
    text = f'Schedule "{title}" on {day} from {start} to {end} with {a.name} and {b.name}.'
    event = {
        "title": title,
        "day": day,
        "start": start,
        "end": end,
        "attendees": [a.email, b.email],
    }
    expect = Expect(events=EventChanges(add=[EventSpec(**event)]))
    lookups = [("search_contacts", {"query": a.name}), ("search_contacts", {"query": b.name})]
    plan = _plan([*lookups, ("create_event", event)])
    late = {**event, "start": f"{hour + 1:02d}:00", "end": f"{hour + 2:02d}:00"}
    return text, expect, plan, _plan([*lookups, ("create_event", late)])


def cancel_event(rng: random.Random, world: WorkplaceState) -> Made:
    event, other = rng.sample(world.events, 2)
    text = f'Cancel the "{event.title}" event on {event.day}.'
    expect = Expect(events=EventChanges(remove=[event.id]))
    look = ("list_events", {"day": event.day})
    plan = _plan([look, ("delete_event", {"event_id": event.id})])
    return text, expect, plan, _plan([look, ("delete_event", {"event_id": other.id})])


def move_event(rng: random.Random, world: WorkplaceState) -> Made:
    event = rng.choice(world.events)
    day = rng.choice([d for d in DAYS if d != event.day])
    text = f'Move the "{event.title}" event on {event.day} to {day}, at the same time.'
    expect = Expect(events=EventChanges(update={event.id: {"day": day}}))
    look = ("list_events", {"day": event.day})
    plan = _plan([look, ("update_event", {"event_id": event.id, "day": day})])
    s, e = int(event.start[:2]) + 1, int(event.end[:2]) + 1
    shifted = {"start": f"{s:02d}{event.start[2:]}", "end": f"{e:02d}{event.end[2:]}"}
    wrong = _plan([look, ("update_event", {"event_id": event.id, "day": day, **shifted})])
    return text, expect, plan, wrong


def manager_phone(rng: random.Random, world: WorkplaceState) -> Made:
    who = rng.choice([c for c in world.contacts if c.manager])
    boss = _by_id(world, who.manager)
    text = f"What is the phone number of {who.name}'s manager? Reply with the number."
    answer = AnswerSpec(kind="phone", value=boss.phone, grounded=boss.id)
    lookups = [("search_contacts", {"query": who.name}), ("search_contacts", {"query": boss.name})]
    plan = _plan(lookups, f"{boss.name}'s number is {boss.phone}.")
    wrong = _plan(lookups, f"{who.name}'s number is {who.phone}.")
    return text, Expect(answer=answer), plan, wrong


def email_code(rng: random.Random, world: WorkplaceState) -> Made:
    mail, other = rng.sample(world.inbox, 2)
    sender = next(c for c in world.contacts if c.email == mail.sender)

    def code(m: Any) -> str:
        return m.body.rsplit("reference code is ", 1)[1].split(".")[0]

    text = (
        f"{sender.name} emailed me about {mail.subject.lower()}. "
        "What reference code is in it? Reply with the code."
    )
    answer = AnswerSpec(kind="code", value=code(mail), grounded=mail.id)
    read = [("list_emails", {}), ("read_email", {"email_id": mail.id})]
    plan = _plan(read, f"The reference code is {code(mail)}.")
    wrong = _plan([*read, ("read_email", {"email_id": other.id})], f"It is {code(other)}.")
    return text, Expect(answer=answer), plan, wrong


TEMPLATES: dict[str, Callable[[random.Random, Any], Made]] = {
    f.__name__: f
    for f in (
        email_contact,
        email_team,
        email_manager,
        email_cc,
        reply,
        forward,
        create_event,
        cancel_event,
        move_event,
        manager_phone,
        email_code,
    )
}


def generate(rng: random.Random, index: int, reset_world: Callable[[int], Any]) -> Prompt:
    """Task ``index``: its template cycles through ``TEMPLATES`` so every sample covers all."""
    seed = rng.randrange(2**31)
    name = list(TEMPLATES)[index % len(TEMPLATES)]
    text, expect, plan, wrong = TEMPLATES[name](rng, reset_world(seed))
    data = {
        "world_seed": seed,
        "template": name,
        "expect": msgspec.to_builtins(expect),
        "plan": plan,
        "wrong_plan": wrong,
    }
    return Prompt([Message(role="system", content=SYSTEM), user(text)], data)
