"""``longdoc``: a long generated register of people, then several questions over several turns.

Every rollout of a group gets the same document in its first user message, so
the group shares a prefix of thousands of tokens (the retrieval-heavy
workload). The document is rebuilt from ``doc_seed`` and ``words`` (or taken
verbatim from the task's ``document``). Each question is worth
``1 / len(questions)``; the rollout's reward is the fraction answered right, and it is
``solved`` when every answer is.
A word answer is right when the reply names it and no other value of the same
kind (naming every town does not score); a year answer when the reply's last
number is that year.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from verbatim.datamodel import Message
from verbatim.envs.answers import final_number, mentions
from verbatim.envs.base import Reset, StepResult
from verbatim.envs.held_out import SHARE
from verbatim.envs.taskfile import TaskSpec, parse_task
from verbatim.errors import InputError

SYSTEM = "Read the document, then answer each question in a few words."

TOWNS = ("Varrow", "Elsmere", "Quillby", "Dunhollow", "Marrowick", "Ostrel", "Fenbridge", "Calderby", "Wexmoor",
         "Brindle", "Harrowgate", "Lussel", "Pennock", "Ravensholt", "Sallowby", "Tamberlin", "Umbridge", "Vexley",
         "Whitcombe", "Yarrowfield")
TRADES = ("glassblower", "ropemaker", "cartographer", "beekeeper", "clockmaker", "tanner", "cooper", "weaver",
          "potter", "bookbinder", "lamplighter", "miller", "saddler", "chandler", "brewer", "fletcher", "mason",
          "shipwright", "dyer", "tinsmith")
VOCABULARY = {"town": TOWNS, "trade": TRADES}
_FIRST = ("Ma", "Te", "Lo", "Bri", "Ca", "Do", "El", "Fi", "Ga", "Ha", "Io", "Ju", "Ke", "Ni", "Or", "Pe", "Ro", "Sa")
_FIRST_END = ("ra", "lin", "na", "th", "ric", "sa", "mon", "ly", "via", "dor")
_LAST = ("Tol", "Bram", "Cask", "Dun", "Ever", "Fal", "Grim", "Hollo", "Ivers", "Jarn", "Kest", "Lum", "Morr", "Nye")
_LAST_END = ("an", "wick", "ley", "stone", "ford", "ington", "er", "mere", "by", "holt")
_OPENERS = (
    "{name} lives in {town} and works as a {trade}; {pronoun} was born in {year}.",
    "Born in {year}, {name} is a {trade} who lives in {town}.",
    "The {trade} {name}, born in {year}, has a house in {town}.",
    "{name} was born in {year}. {Pronoun} lives in {town}, where {pronoun} works as a {trade}.",
)
_COLOUR = ("grey", "green", "red", "blue", "yellow", "white", "brown", "black")
_FILLERS = (
    "The house has a {colour} door and a small garden with {count} apple trees.",
    "Neighbours say {pronoun} walks to the market every {day} morning.",
    "{Pronoun} keeps {count} old letters in a {colour} box under the stairs.",
    "On rainy evenings {pronoun} reads by a lamp with a {colour} shade.",
    "{Pronoun} once travelled for {count} days to visit a cousin by the sea.",
)
_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
ASK = {"town": "In which town does {name} live?", "trade": "What is the trade of {name}?",
       "year": "In which year was {name} born?"}


class Question(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    question: str
    answer: str
    kind: str = "custom"
    """``town`` / ``trade`` (other values of the kind must not be named), ``year`` (number) or ``custom``."""


class LongDocTask(TaskSpec):
    questions: tuple[Question, ...] = Field(min_length=1)
    doc_seed: int | None = None
    words: int = Field(default=2000, ge=50)
    document: str | None = None

    @model_validator(mode="after")
    def _has_document(self) -> LongDocTask:
        if self.document is None and self.doc_seed is None:
            raise ValueError("give a document or a doc_seed")
        return self


def person_names(rng: random.Random) -> Iterator[str]:
    """Distinct invented full names, in an order fixed by ``rng``."""
    seen: set[str] = set()
    while True:
        name = rng.choice(_FIRST) + rng.choice(_FIRST_END) + " " + rng.choice(_LAST) + rng.choice(_LAST_END)
        if name not in seen:
            seen.add(name)
            yield name


def build_register(doc_seed: int, words: int) -> tuple[str, list[dict[str, Any]]]:
    """The document (at least ``words`` words) and the facts it states, both fixed by the seed."""
    rng = random.Random(f"longdoc:{doc_seed}")
    names = person_names(rng)
    paragraphs = ["Register of the Valley Guilds. Each entry below describes one member."]
    people, count = [], len(paragraphs[0].split())
    while count < words:
        person = {"name": next(names), "town": rng.choice(TOWNS), "trade": rng.choice(TRADES),
                  "year": rng.randint(1780, 1920)}
        paragraph = f"Entry {len(people) + 1}. " + _paragraph(rng, person)
        paragraphs.append(paragraph)
        people.append(person)
        count += len(paragraph.split())
    return "\n\n".join(paragraphs), people


def _paragraph(rng: random.Random, person: dict[str, Any]) -> str:
    pronoun = rng.choice(("she", "he"))
    fields = person | {"pronoun": pronoun, "Pronoun": pronoun.capitalize()}
    sentences = [rng.choice(_OPENERS).format(**fields)]
    for filler in rng.sample(_FILLERS, 2):
        sentences.append(filler.format(colour=rng.choice(_COLOUR), count=rng.randint(2, 19),
                                       day=rng.choice(_DAYS), **fields))
    return " ".join(sentences)


def is_correct(reply: str, question: Question) -> bool:
    if question.kind == "year":
        got = final_number(reply)
        return got is not None and got.is_integer() and str(int(got)) == question.answer
    if not mentions(reply, question.answer):
        return False
    others = VOCABULARY.get(question.kind, ())
    return not any(mentions(reply, other) for other in others if other.lower() != question.answer.lower())


class LongDocEnv:
    """Question ``i`` is asked after answer ``i - 1``; the episode ends after the last answer."""

    name = "longdoc"

    def __init__(self) -> None:
        self.task: LongDocTask | None = None
        self.results: list[bool] = []

    def reset(self, task: dict[str, Any], seed: int) -> Reset:
        self.task = parse_task(LongDocTask, task, self.name)
        self.results = []
        document = self.task.document or build_register(self.task.doc_seed, self.task.words)[0]
        opening = f"{document}\n\n{self._question(0)}"
        return Reset(messages=(Message(role="system", content=SYSTEM), Message(role="user", content=opening)))

    def _question(self, index: int) -> str:
        return f"Question {index + 1} of {len(self.task.questions)}: {self.task.questions[index].question}"

    def step(self, message: Message) -> StepResult:
        if self.task is None:
            raise RuntimeError("LongDocEnv.step before reset")
        questions = self.task.questions
        correct = is_correct(message.content, questions[len(self.results)])
        self.results.append(correct)
        done = len(self.results) >= len(questions)
        info = {"answered": len(self.results), "correct": list(self.results),
                "score": sum(self.results) / len(questions), "solved": done and all(self.results)}
        reward = 1.0 / len(questions) if correct else 0.0
        if done:
            return StepResult(reward=reward, done=True, info=info)
        return StepResult(messages=(Message(role="user", content=self._question(len(self.results))),),
                          reward=reward, info=info)


class LongDocFactory:
    """Tasks: a register of about ``words`` words per task and ``questions`` questions on distinct people."""

    name = "longdoc"

    def __init__(self, words: int = 2000, questions: int = 3) -> None:
        if words < 50 or questions < 1:
            raise InputError("longdoc needs words >= 50 and questions >= 1")
        self.words, self.questions = words, questions

    def make(self) -> LongDocEnv:
        return LongDocEnv()

    def turns_needed(self, task: dict[str, Any]) -> int:
        """One model turn per question."""
        return len(parse_task(LongDocTask, task, self.name).questions)

    def held_out(self, task: dict[str, Any]) -> bool:
        """Held out from training for evaluation (envs/held_out.py): the documents of one seed in five."""
        return int(task["doc_seed"]) % SHARE == 0

    def tasks(self, count: int, seed: int) -> Sequence[dict[str, Any]]:
        rng = random.Random(f"longdoc-tasks:{seed}")
        out = []
        for i in range(count):
            doc_seed = rng.randrange(2**31)
            _, people = build_register(doc_seed, self.words)
            chosen = rng.sample(people, min(self.questions, len(people)))
            questions = []
            for person in chosen:
                kind = rng.choice(tuple(ASK))
                questions.append({"question": ASK[kind].format(name=person["name"]),
                                  "answer": str(person[kind]), "kind": kind})
            out.append({"id": f"longdoc-{seed}-{i}", "doc_seed": doc_seed, "words": self.words,
                        "questions": questions})
        return out
