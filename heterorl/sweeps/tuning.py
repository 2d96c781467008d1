"""Each loss's setting chosen from a tuning sweep, by the rule of docs/EXPERIMENTS.md ("Tuning budget (round 3)").

A tuning sweep (experiments/configs/tune_maze4.yaml) runs every loss at a few settings of its main knob on one task
at one staleness. The loss at its defaults is labelled by its name (``gepo``), each other setting
``LOSS@KNOB=VALUE`` (``gepo@clip_eps=0.1``). Per loss, the setting whose runs score highest is chosen, a run's score
being its mean held-out success over its last `LAST_EVALS` evals (averaged over the setting's finished runs: one
seed in a tuning sweep); a tie with the default goes to the default, a tie between other settings to the first in
sweep order.

    choices = choose_settings([cell.summary for cell in sweep.cells], sweep.losses)
    choices["gepo"].chosen          # e.g. "gepo@clip_eps=0.1"
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import fmean
from typing import Iterable, Mapping, Sequence

from heterorl.sweeps.stats import LAST_EVALS, last_evals_mean

SETTING = "@"  # separates the loss from its setting in a sweep label
TIE_ABS = 1e-9  # scores closer than this are the same evals up to float rounding: a tie


def loss_of(label: str) -> str:
    """The loss a sweep label sets: ``gepo@clip_eps=0.1`` → ``gepo``; the bare ``gepo`` is the loss's default."""
    return label.partition(SETTING)[0]


@dataclass(frozen=True)
class Choice:
    """One loss's settings and the one chosen."""

    loss: str
    chosen: str  # the label of the setting chosen
    scores: dict[str, float]  # label → score, for each setting with a finished run, in sweep order
    missing: tuple[str, ...]  # the loss's settings without a finished run, which the choice did not see


def choose_settings(summaries: Iterable[Mapping], labels: Sequence[str]) -> dict[str, Choice]:
    """Per loss, in the order of ``labels`` (the sweep's loss labels), the setting chosen by the rule of the module
    docstring from the cells' ``summary.json`` contents (``status``, ``task``, ``delay``, ``loss``: the cell's
    label, ``history``: its evals). Only finished runs that evaluated after the base count; a loss none of whose
    settings has one is left out. Raises ValueError when those runs span more than one (task, delay): a setting
    is chosen at one."""
    runs = [s for s in summaries if s.get("status") == "done" and any(r["step"] > 0 for r in s.get("history", ()))]
    where = sorted({(str(s["task"]), str(s["delay"])) for s in runs})
    if len(where) > 1:
        raise ValueError(f"a tuning sweep chooses at one (task, delay); these runs span {where}: "
                         "report the settings of one at a time")
    scores_of: dict[str, list[float]] = {}
    for summary in runs:
        scores_of.setdefault(summary["loss"], []).append(last_evals_mean(summary["history"], LAST_EVALS))
    choices = {}
    for loss in dict.fromkeys(map(loss_of, labels)):
        settings = [label for label in labels if loss_of(label) == loss]
        scores = {label: fmean(scores_of[label]) for label in settings if label in scores_of}
        if not scores:
            continue
        best = max(scores.values())
        tied = [label for label, score in scores.items() if math.isclose(score, best, rel_tol=0, abs_tol=TIE_ABS)]
        chosen = loss if loss in tied else tied[0]
        choices[loss] = Choice(loss, chosen, scores, tuple(label for label in settings if label not in scores))
    return choices


def tuning_section(summaries: Iterable[Mapping], labels: Sequence[str]) -> list[str]:
    """The report's "Tuning" section, as lines: per loss the setting chosen and every setting's score in points;
    none for a sweep without settings (no label with ``@``)."""
    if not any(SETTING in label for label in labels):
        return []
    lines = ["## Tuning: the setting chosen per loss", ""]
    try:
        choices = choose_settings(summaries, labels)
    except ValueError as exc:
        return [*lines, f"Not chosen: {exc}.", ""]
    lines += ["| loss | chosen | score of each setting (last evals, points) | not finished |",
              "| --- | --- | --- | --- |"]
    for choice in choices.values():
        scores = "; ".join(_bold(f"{label} {100 * score:.1f}", label == choice.chosen)
                           for label, score in choice.scores.items())
        lines.append(f"| {choice.loss} | `{choice.chosen}` | {scores} | {', '.join(choice.missing) or '—'} |")
    return [*lines, "", f"Chosen per loss: the setting with the best mean held-out success over its last {LAST_EVALS} "
                        "evals; a tie goes to the default (the bare loss name). A loss with a setting not finished "
                        "is chosen among those that finished (heterorl/sweeps/tuning.py).", ""]


def _bold(text: str, bold: bool) -> str:
    return f"**{text}**" if bold else text


__all__ = ["Choice", "SETTING", "choose_settings", "loss_of", "tuning_section"]
