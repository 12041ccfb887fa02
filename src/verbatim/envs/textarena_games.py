"""``--env textarena:ID``: TextArena's single-player games as verbatim envs, through their ``-raw`` ids.

A raw game hands over its observations as ``(from, text, kind)`` records with no wrapper's re-rendering of
the board or the history. Each turn the env passes on only what is new since the model's last move, and
leaves out the echo of the model's own move (the trace holds that move as sampled already). The reward is
the game's own, from ``close()`` when the game ends, unchanged; the game's info goes in the turn's info.

TextArena seeds Python's global ``random`` in ``reset`` and draws from it while it plays; rollouts play
concurrently, so every call into a game runs under one lock with that game's own random state swapped in
and out: a rollout's game depends on its seed alone. ``--env-arg KEY=VALUE`` goes to ``textarena.make``
(e.g. ``max_turns=3``). A game for more than one player, one that calls a language model or one that needs
the network is refused with the reason. Install with ``pip install 'verbatim-rl[textarena]'``.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from verbatim.datamodel import Message
from verbatim.envs.base import Reset, StepResult
from verbatim.envs.library_rules import entry_name, refuse_unfit, reply_text
from verbatim.errors import DependencyError, InputError, install_hint

PREFIX = "textarena:"
RAW = "-raw"
_RANDOM = threading.Lock()
"""Held around every call into a game: Python's global random is the games' shared state."""


class TextArenaFactory:
    """Makes one raw TextArena game per rollout; tasks come from ``--tasks`` (``{"seed": N}`` or ``{}``)."""

    def __init__(self, game_id: str, **options: Any) -> None:
        try:
            import textarena
            from textarena.envs.registration import ENV_REGISTRY
        except ImportError:
            raise DependencyError("textarena is not installed",
                                  hint=install_hint("textarena")) from None
        raw = game_id if game_id.endswith(RAW) else game_id + RAW
        if raw not in ENV_REGISTRY:
            raise InputError(f"TextArena has no game {game_id!r}", hint="use a registered id such as "
                             "GuessTheNumber-v0 (its -raw variant is played)")
        refuse_unfit(Path(textarena.__file__).parent.parent, entry_name(ENV_REGISTRY[raw].entry_point), "TextArena",
                     game_id)
        self.game_id, self.raw, self.options = game_id, raw, options
        self.name, self._make = f"{PREFIX}{game_id}", textarena.make
        self._check_single_player()

    def _check_single_player(self) -> None:
        game = TextArenaGame(self)
        try:
            game.start(seed=0)
        except Exception as exc:  # noqa: BLE001 - TextArena says "players" in its own words
            raise InputError(f"TextArena's {self.game_id} does not start for one player: {exc}",
                             hint="verbatim plays TextArena's single-player games") from None

    def make(self) -> TextArenaGame:
        return TextArenaGame(self)

    def tasks(self, count: int, seed: int) -> Sequence[dict[str, Any]]:
        """One game per group, seeded from the run's seed (a task file may give ``{"seed": N}`` instead)."""
        return [{"game": self.game_id, "seed": seed * 1_000 + g} for g in range(count)]


class TextArenaGame:
    def __init__(self, factory: TextArenaFactory) -> None:
        self.factory, self.name = factory, factory.name
        self.game: Any = None
        self._state: Any = None

    @contextlib.contextmanager
    def _own_random(self) -> Iterator[None]:
        with _RANDOM:
            saved = random.getstate()
            if self._state is not None:
                random.setstate(self._state)
            try:
                yield
            finally:
                self._state = random.getstate()
                random.setstate(saved)

    def start(self, seed: int) -> str:
        with self._own_random():
            self.game = self.factory._make(self.factory.raw, **self.factory.options)
            self.game.reset(num_players=1, seed=seed)
            return self._news()

    def reset(self, task: dict[str, Any], seed: int) -> Reset:
        game_seed = task.get("seed", seed)
        if not isinstance(game_seed, int) or isinstance(game_seed, bool):
            raise InputError(f"{self.name} task: seed must be an integer")
        return Reset(messages=(Message(role="user", content=self.start(game_seed)),))

    def step(self, message: Message) -> StepResult:
        with self._own_random():
            done, info = self.game.step(action=reply_text(message))
            if not done:
                return StepResult(messages=(Message(role="user", content=self._news()),), info=_plain(info))
            rewards, game_info = self.game.close()
        reward = float((rewards or {}).get(0, 0.0))
        return StepResult(reward=reward, done=True, info={"game": _plain(game_info), "rewards": _plain(rewards)})

    def _news(self) -> str:
        """What the player sees that is new, less the echo of its own move (a single player's game echoes
        only that player's moves, from the player or from the game: TowerOfHanoi sends it as the game's)."""
        _, records = self.game.get_observation()
        return "\n".join(text for _, text, kind in records if getattr(kind, "name", "") != "PLAYER_ACTION")


def _plain(value: Any) -> Any:
    """TextArena's info as JSON-able data (its keys may be player ids)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if isinstance(value, (str, int, float, bool)) or value is None else str(value)
