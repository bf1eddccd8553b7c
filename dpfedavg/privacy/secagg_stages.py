"""The node's rules for a SecAgg+ stage's own parameters: pure checks, before ``secaggplus_mod`` sees a stage.

Flower's SecAgg+ (Bell et al. 2020) hides a node's vector only while the server follows the protocol. A node
checks each stage's parameters and the stages' order against its own record of the protocol (`record_after()`,
kept by `dpfedavg.flower.guard.answer_stage()` in the node's context) and its policy's ``secagg-min-cohort``
(`stage_refusal()`); the masked-vector stage is answered only for the cohort the setup admitted
(`admitted_cohort()`). No Flower message here: the node's guard (`dpfedavg.flower.guard`) reads the stage
(`SecAggStage`) and applies the verdict.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dpfedavg.privacy.policy import NodePolicy, RoundRefused

__all__ = ["SETUP_KEYS", "Key", "Stage", "SecAggStage", "admitted_cohort", "record_after", "stage_refusal"]


class Stage:
    """Flower's SecAgg+ stage names (``flwr``'s ``secaggplus_constants.Stage``; a test checks they are the same)."""

    SETUP, SHARE_KEYS, COLLECT_MASKED_VECTORS, UNMASK = "setup", "share_keys", "collect_masked_vectors", "unmask"

    @staticmethod
    def all() -> tuple[str, ...]:
        return (Stage.SETUP, Stage.SHARE_KEYS, Stage.COLLECT_MASKED_VECTORS, Stage.UNMASK)


class Key:
    """The keys of Flower's SecAgg+ stage configs the node checks (``secaggplus_constants.Key``; tested the same)."""

    STAGE, SAMPLE_NUMBER, SHARE_NUMBER, THRESHOLD = "stage", "sample_num", "share_num", "threshold"
    ACTIVE_NODE_ID_LIST, DEAD_NODE_ID_LIST = "active_nids", "dead_nids"


LAST_STAGE = "stage"
#: The setup stage's parameters the node checks and keeps (Flower's keys).
SETUP_KEYS = (Key.SAMPLE_NUMBER, Key.SHARE_NUMBER, Key.THRESHOLD)
#: The stage each SecAgg+ stage must follow (the setup may come at any time: a new round of the protocol).
_AFTER = {Stage.SHARE_KEYS: Stage.SETUP, Stage.COLLECT_MASKED_VECTORS: Stage.SHARE_KEYS,
          Stage.UNMASK: Stage.COLLECT_MASKED_VECTORS}  # fmt: skip


@dataclass(frozen=True)
class SecAggStage:
    """A SecAgg+ stage message as the node checks it (`dpfedavg.flower.guard.secagg_stage_of()`).

    ``stage``: Flower's stage name (``bypassed`` for content outside the protocol); ``configs``: the stage's
    parameters (Flower's keys), ``None`` inside ``secaggplus_mod``, which has taken them (``dp_mod``: only the
    record is read there); ``node_id``: this node's id; ``record``: the node's record of the stages it answered
    so far (`record_after()`; ``None``: none since the last refusal).
    """

    stage: str
    configs: Mapping[str, Any] | None
    node_id: int
    record: Mapping[str, Any] | None


def stage_refusal(policy: NodePolicy, checked: SecAggStage) -> str | None:
    """Why the node refuses a SecAgg+ stage message before ``secaggplus_mod`` sees it, or ``None``.

    Flower's SecAgg+ (Bell et al. 2020, on Bonawitz et al. 2017) protects a node's vector only if the server
    follows it: with a cohort of one, or one share and threshold 1, or a node listed both active and dropped
    in the unmask stage, the server rebuilds the node's mask seed and key and reads its vector (issue 46). The
    node's rules, each before the stage's secret leaves it: the setup's cohort ``sample_num >=
    secagg-min-cohort``, ``3 <= share_num <= sample_num`` and a majority threshold ``share_num / 2 < threshold
    <= share_num`` (an honest node then hands over at most one of a neighbour's two secrets); the stages in
    order, each once per round (`_AFTER`: one unmask request, after this node's masked vector); the public keys
    of at most ``share_num`` and at least ``threshold`` neighbours; in the unmask stage no node listed twice or
    both active and dropped, this node among the active and at least ``threshold`` active.
    """
    configs, stage = checked.configs or {}, checked.stage
    if stage == Stage.SETUP:
        return _setup_refusal(policy, configs)
    if stage not in _AFTER:
        return f"refused (SecAgg+ stage): unknown stage {stage!r}; expected one of {', '.join(Stage.all())}"
    record = checked.record or {}
    last = record.get(LAST_STAGE)
    if last != _AFTER[stage]:
        after = f"after the {last!r} stage" if last else "without a setup stage this node admitted"
        if stage == Stage.UNMASK:
            return (f"refused (SecAgg+ unmask): an unmask request {after}; this node answers one unmask request "
                    "per round, after its masked vector (a second one could ask for the other secret of a node)")
        return f"refused (SecAgg+ stage): a {stage!r} stage {after}; expected it after {_AFTER[stage]!r}"
    shares, threshold = int(record[Key.SHARE_NUMBER]), int(record[Key.THRESHOLD])
    if stage == Stage.SHARE_KEYS:
        keys = len([key for key in configs if key != Key.STAGE])
        if not threshold <= keys <= shares:
            return (f"refused (SecAgg+ shares): the public keys of {keys} nodes, with share_num = {shares} and "
                    f"threshold = {threshold}: expected between threshold and share_num")
    if stage == Stage.UNMASK:
        return _unmask_refusal(configs, checked.node_id, threshold)
    return None


def _setup_refusal(policy: NodePolicy, configs: Mapping[str, Any]) -> str | None:
    """The setup stage's cohort, share count and threshold (`stage_refusal()`)."""
    values = {key: configs.get(key) for key in SETUP_KEYS}
    if any(type(v) is not int for v in values.values()):  # bool is not a count
        return f"refused (SecAgg+ setup): {values} must be integers (sample_num, share_num, threshold)"
    cohort, shares, threshold = (int(values[key]) for key in SETUP_KEYS)  # type: ignore[call-overload]
    if cohort < policy.secagg_min_cohort:
        default = "" if "secagg-min-cohort" in policy.stated else " (the default)"
        return str(RoundRefused(
            "secagg-min-cohort", f"a SecAgg+ cohort of {cohort} nodes (sample_num); this node takes part in cohorts of "
            f"at least {policy.secagg_min_cohort}{default} (in a smaller one the sum shows what this node sent)",
            policy=True,
        ))  # fmt: skip
    if not 3 <= shares <= cohort:
        return (f"refused (SecAgg+ shares): share_num = {shares} with sample_num = {cohort}: expected 3 <= share_num "
                "<= sample_num (a node's keys are shared with at least two other nodes of the cohort)")
    if not shares < 2 * threshold <= 2 * shares:
        return (f"refused (SecAgg+ threshold): threshold = {threshold} with share_num = {shares}: expected "
                f"share_num / 2 < threshold <= share_num (a majority of a node's shares, so that no server can rebuild "
                "both its mask seed and its key)")
    return None


def _unmask_refusal(configs: Mapping[str, Any], node_id: int, threshold: int) -> str | None:
    """The unmask stage's lists: nobody twice, nobody active and dropped, this node active (`stage_refusal()`)."""
    active, dropped = configs.get(Key.ACTIVE_NODE_ID_LIST), configs.get(Key.DEAD_NODE_ID_LIST)
    if not isinstance(active, list) or not isinstance(dropped, list):
        return "refused (SecAgg+ unmask): the active and dropped node lists are missing"
    both = sorted(set(active) & set(dropped), key=str)
    if both:
        return (f"refused (SecAgg+ unmask): node(s) {both} listed both active and dropped: the server would receive "
                "the shares of both their mask seed and their key, and read their vectors")
    if len(set(active)) != len(active) or len(set(dropped)) != len(dropped):
        return "refused (SecAgg+ unmask): a node is listed twice"
    if node_id not in active:
        return (f"refused (SecAgg+ unmask): this node ({node_id}) is not listed active, yet it sent its masked vector "
                "and is asked to unmask")
    if len(active) < threshold:
        return f"refused (SecAgg+ unmask): {len(active)} active neighbours, below the threshold {threshold}"
    return None


def record_after(checked: SecAggStage) -> dict[str, Any]:
    """The node's record once it answered the stage ``checked`` (which had its parameters): the last stage answered,
    and the cohort, share count and threshold of the setup it admitted."""
    assert checked.configs is not None
    if checked.stage == Stage.SETUP:
        return {**{key: checked.configs[key] for key in SETUP_KEYS}, LAST_STAGE: checked.stage}
    return {**(checked.record or {}), LAST_STAGE: checked.stage}


def admitted_cohort(record: Mapping[str, Any] | None) -> int | None:
    """The setup's cohort ``sample_num`` if the node checked every stage before its masked vector, else ``None``."""
    if record is None or record.get(LAST_STAGE) != Stage.SHARE_KEYS:
        return None
    return int(record[Key.SAMPLE_NUMBER])
