"""``workplace``: an office (contacts, email, calendar) the agent works through tools.

The world is rebuilt from ``task.data["world_seed"]`` (see ``_workplace_tasks``), so a task is
small and the verifier can recompute the initial state. Tasks come from eleven templates
(emails to a person, a team, a manager, with cc; replies; forwards; creating, cancelling and
moving events; and two questions answered in text). The episode ends at the first plain
assistant message.

Reward: see ``streamrl.verifiers.workplace``: 1.0 when the sent emails, the calendar and (for
questions) the answer match the expected outcome exactly, else 0.0.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

import msgspec

from streamrl.envs import _workplace_tasks as tasks
from streamrl.envs.base import (
    Environment,
    Prompt,
    StepResult,
    ToolError,
    Verdict,
    last_assistant_text,
)
from streamrl.schema import (
    FunctionCall,
    FunctionCallOutput,
    FunctionTool,
    Item,
    Message,
    Task,
    Trajectory,
)
from streamrl.verifiers import workplace as checker
from streamrl.verifiers.workplace_state import Email, Event, WorkplaceState


def _tool(name: str, description: str, required: list[str], **props: Any) -> FunctionTool:
    return FunctionTool(
        name=name,
        description=description,
        parameters={
            "type": "object",
            "properties": props,
            "required": required,
            "additionalProperties": False,
        },
    )


_S = {"type": "string"}
_ADDRESSES = {"type": "array", "items": {"type": "string"}}
_DAY = {"type": "string", "description": "YYYY-MM-DD"}
_TIME = {"type": "string", "description": "HH:MM, 24-hour"}
_TOOLS = [
    _tool("search_contacts", "Find colleagues by name, email, team or title.", ["query"], query=_S),
    _tool(
        "list_emails",
        "List emails (id, from/to, subject, day) in a folder.",
        [],
        folder={"type": "string", "enum": ["inbox", "sent"]},
    ),
    _tool("read_email", "Show one email in full.", ["email_id"], email_id=_S),
    _tool(
        "send_email",
        "Send an email.",
        ["to", "subject", "body"],
        to=_ADDRESSES,
        subject=_S,
        body=_S,
        cc=_ADDRESSES,
    ),
    _tool(
        "reply_email",
        "Reply to the sender of an inbox email.",
        ["email_id", "body"],
        email_id=_S,
        body=_S,
    ),
    _tool(
        "forward_email",
        "Forward an inbox email, with an optional note.",
        ["email_id", "to"],
        email_id=_S,
        to=_ADDRESSES,
        body=_S,
    ),
    _tool("list_events", "List calendar events, optionally of one day.", [], day=_DAY),
    _tool(
        "create_event",
        "Add a calendar event.",
        ["title", "day", "start", "end"],
        title=_S,
        day=_DAY,
        start=_TIME,
        end=_TIME,
        attendees=_ADDRESSES,
    ),
    _tool("delete_event", "Delete a calendar event.", ["event_id"], event_id=_S),
    _tool(
        "update_event",
        "Change an event's title, day or times.",
        ["event_id"],
        event_id=_S,
        title=_S,
        day=_DAY,
        start=_TIME,
        end=_TIME,
    ),
]

_DAY_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_TIME_RE = re.compile(r"^([01]\d|2[0-3]):[0-5]\d$")


class WorkplaceEnv(Environment[WorkplaceState]):
    name = "workplace"
    version = "1"
    State = WorkplaceState
    tools = _TOOLS

    def generate(self, rng: random.Random, index: int) -> Prompt:
        return tasks.generate(rng, index, self.reset_world)

    @staticmethod
    def reset_world(world_seed: int) -> WorkplaceState:
        return msgspec.convert(tasks.build_world(world_seed), WorkplaceState)

    def reset(self, task: Task) -> WorkplaceState:
        return self.reset_world(int(task.data["world_seed"]))

    # ------------------------------------------------------------ tools

    def step(self, state: WorkplaceState, name: str, arguments: dict[str, Any]) -> StepResult:
        return getattr(self, f"_{name}")(state, **arguments)

    @staticmethod
    def _show(state: WorkplaceState, output: Any, ids: list[str]) -> StepResult:
        seen = sorted(set(state.seen) | set(ids))
        return StepResult(json.dumps(output), msgspec.structs.replace(state, seen=seen))

    def _search_contacts(self, state: WorkplaceState, query: str) -> StepResult:
        q = query.lower().strip()
        if not q:
            raise ToolError("query is empty")
        names = {c.id: c.name for c in state.contacts}
        hits = [
            c
            for c in state.contacts
            if any(q in f.lower() for f in (c.name, c.email, c.team, c.title))
        ]
        out = [
            {
                "name": c.name,
                "email": c.email,
                "phone": c.phone,
                "team": c.team,
                "title": c.title,
                "manager": names.get(c.manager, ""),
            }
            for c in hits
        ]
        return self._show(state, out, [c.id for c in hits])

    def _list_emails(self, state: WorkplaceState, folder: str = "inbox") -> StepResult:
        box = state.inbox if folder == "inbox" else state.sent
        out = [
            {"id": e.id, "from": e.sender, "to": e.to, "subject": e.subject, "day": e.day}
            for e in box
        ]
        return StepResult(json.dumps(out), state)

    def _find_email(self, state: WorkplaceState, email_id: str) -> Email:
        for e in (*state.inbox, *state.sent):
            if e.id == email_id:
                return e
        raise ToolError(f"no email with id {email_id!r}")

    def _read_email(self, state: WorkplaceState, email_id: str) -> StepResult:
        return self._show(state, msgspec.to_builtins(self._find_email(state, email_id)), [email_id])

    def _check_addresses(self, state: WorkplaceState, addresses: list[str]) -> list[str]:
        known = {c.email.lower() for c in state.contacts} | {state.me.lower()}
        unknown = [a for a in addresses if a.lower() not in known]
        if unknown:
            raise ToolError(f"unknown address(es) {unknown}; use search_contacts")
        return addresses

    def _send(
        self, state: WorkplaceState, to: list[str], subject: str, body: str, cc: list[str] = ()
    ) -> StepResult:
        if not to:
            raise ToolError("'to' is empty")
        email = Email(
            id=f"s{state.next_id}",
            sender=state.me,
            day=tasks.TODAY,
            subject=subject,
            body=body,
            to=self._check_addresses(state, to),
            cc=self._check_addresses(state, list(cc)),
        )
        new = msgspec.structs.replace(state, sent=[*state.sent, email], next_id=state.next_id + 1)
        return StepResult(f"sent {email.id}", new)

    def _send_email(
        self, state: WorkplaceState, to: list[str], subject: str, body: str, cc: list[str] = ()
    ) -> StepResult:
        return self._send(state, to, subject, body, cc)

    def _reply_email(self, state: WorkplaceState, email_id: str, body: str) -> StepResult:
        original = self._find_email(state, email_id)
        return self._send(state, [original.sender], f"Re: {original.subject}", body)

    def _forward_email(
        self, state: WorkplaceState, email_id: str, to: list[str], body: str = ""
    ) -> StepResult:
        original = self._find_email(state, email_id)
        text = f"{body}\n\n---------- Forwarded message ----------\n{original.body}".lstrip()
        return self._send(state, to, f"Fwd: {original.subject}", text)

    def _list_events(self, state: WorkplaceState, day: str | None = None) -> StepResult:
        events = sorted(
            (e for e in state.events if day is None or e.day == day), key=lambda e: (e.day, e.start)
        )
        return StepResult(json.dumps([msgspec.to_builtins(e) for e in events]), state)

    def _event(self, state: WorkplaceState, event_id: str) -> Event:
        for e in state.events:
            if e.id == event_id:
                return e
        raise ToolError(f"no event with id {event_id!r}")

    @staticmethod
    def _check_times(day: str, start: str, end: str) -> None:
        if not _DAY_RE.match(day):
            raise ToolError(f"day {day!r} is not YYYY-MM-DD")
        if not (_TIME_RE.match(start) and _TIME_RE.match(end)):
            raise ToolError("times must be HH:MM (24-hour)")
        if start >= end:
            raise ToolError("an event must end after it starts")

    def _create_event(
        self,
        state: WorkplaceState,
        title: str,
        day: str,
        start: str,
        end: str,
        attendees: list[str] = (),
    ) -> StepResult:
        self._check_times(day, start, end)
        event = Event(
            id=f"ev{state.next_id}",
            title=title,
            day=day,
            start=start,
            end=end,
            attendees=self._check_addresses(state, list(attendees)),
        )
        new = msgspec.structs.replace(
            state, events=[*state.events, event], next_id=state.next_id + 1
        )
        return StepResult(f"created {event.id}", new)

    def _delete_event(self, state: WorkplaceState, event_id: str) -> StepResult:
        self._event(state, event_id)
        events = [e for e in state.events if e.id != event_id]
        return StepResult(f"deleted {event_id}", msgspec.structs.replace(state, events=events))

    def _update_event(self, state: WorkplaceState, event_id: str, **changes: str) -> StepResult:
        event = msgspec.structs.replace(self._event(state, event_id), **changes)
        self._check_times(event.day, event.start, event.end)
        events = [event if e.id == event_id else e for e in state.events]
        return StepResult(f"updated {event_id}", msgspec.structs.replace(state, events=events))

    # ------------------------------------------------------------ scoring and agents

    def verify(self, task: Task, trajectory: Trajectory, state: WorkplaceState) -> Verdict:
        expect = msgspec.convert(task.data["expect"], checker.Expect)
        text = last_assistant_text(trajectory.items)
        return checker.check(self.reset(task), state, expect, text)

    def _follow(self, plan: dict[str, Any], items: list[Item]) -> Item:
        done = sum(isinstance(i, FunctionCallOutput) for i in items)
        calls = plan["calls"]
        if done < len(calls):
            tool, args = calls[done]
            return FunctionCall(call_id=f"call_{done}", name=tool, arguments=json.dumps(args))
        return Message(role="assistant", content=plan["final"])

    def reference(self, task: Task, items: list[Item], state: WorkplaceState) -> Item:
        return self._follow(task.data["plan"], items)

    def wrong(self, task: Task, items: list[Item], state: WorkplaceState) -> Item:
        """A plausible mistake per template: the wrong person, time, event or value."""
        return self._follow(task.data["wrong_plan"], items)
