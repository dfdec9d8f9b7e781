"""One episode: its stages (`episode.py`), its players (`react.py`, agentrl's loop;
`harness.py`, an external harness through the gateway), how it is made (`factory.py`),
its conversation, opened and rebuilt (`conversation.py`), and the journal a killed run's
episodes go on from (`journal.py`). A player sees only the
narrow context of `agentrl.play`."""

from agentrl.episode.conversation import conversation, open_chat, seen_messages
from agentrl.episode.episode import Episode, player_for
from agentrl.episode.factory import Episodes, make_env, run_episode
from agentrl.play import EpisodeEnd, Gate, Play, Player, no_gate

__all__ = [
    "Episode",
    "EpisodeEnd",
    "Episodes",
    "Gate",
    "Play",
    "Player",
    "conversation",
    "make_env",
    "no_gate",
    "open_chat",
    "player_for",
    "run_episode",
    "seen_messages",
]
