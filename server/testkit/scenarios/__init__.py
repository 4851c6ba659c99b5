"""Spoken scenario tests of a playbook: write down what a caller says and what the agent must do,
and check it through a real call (``vocable test``, or :func:`run_scenario` in a pytest suite).

- :mod:`.model`: the scenario file format; :mod:`.files`: finding and loading files.
- :mod:`.runner`: :class:`ScenarioRig` runs scenarios through a server (WebRTC or SIP) or
  typed to the playbook; :mod:`.report`: readable, JSON and JUnit reports of the results.
"""

from .files import LoadedScenario, ScenarioError, find_scenarios, load_scenario
from .model import Scenario
from .result import CheckResult, Failure, ScenarioResult, TurnResult
from .runner import AgentLLM, RigOptions, ScenarioRig, run_scenario

__all__ = [
    "AgentLLM",
    "CheckResult",
    "Failure",
    "LoadedScenario",
    "RigOptions",
    "Scenario",
    "ScenarioError",
    "ScenarioResult",
    "ScenarioRig",
    "TurnResult",
    "find_scenarios",
    "load_scenario",
    "run_scenario",
]
