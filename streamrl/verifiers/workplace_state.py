"""The ``workplace`` office as data: contacts, email, calendar. Its own module because the
environment, its task templates and its verifier all use these types and none of them should
import another one just to name them."""

from __future__ import annotations

import msgspec


class Contact(msgspec.Struct, kw_only=True):
    id: str
    name: str
    email: str
    phone: str
    team: str
    title: str
    manager: str = ""  # the manager's contact id


class Email(msgspec.Struct, kw_only=True):
    id: str
    sender: str
    to: list[str]
    cc: list[str] = []
    subject: str
    body: str
    day: str


class Event(msgspec.Struct, kw_only=True):
    id: str
    title: str
    day: str
    start: str
    end: str
    attendees: list[str] = []


class WorkplaceState(msgspec.Struct, kw_only=True):
    me: str
    contacts: list[Contact]
    inbox: list[Email]
    sent: list[Email] = []
    events: list[Event] = []
    next_id: int = 1
    seen: list[str] = []  # ids of the records tools have shown the agent, for grounding answers
