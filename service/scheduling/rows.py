"""Pure helpers of the scheduler's row building: the order a row is filled in, and how the last
of a burst's work is shared out across GPUs."""

from __future__ import annotations


def water_level(amount: float, loads: list[float]) -> float:
    """The level ``h`` at which ``sum(max(0, h - load))`` over ``loads`` is ``amount``: what the
    least loaded bin takes so that pouring ``amount`` into all of them levels them."""
    below = 0.0
    ordered = sorted(loads)
    for k, load in enumerate(ordered, start=1):
        below += load
        level = (amount + below) / k
        if k == len(ordered) or level <= ordered[k]:
            return level - ordered[0]
    return amount


def gpu_loads(taken: list, unstarted, rate: float, now: float) -> list[float]:
    """Tokens each GPU has still to run at ``rate`` tokens/s: ``taken`` holds, by GPU, its row's
    ``(monotonic time taken, tokens)`` or None when idle; each of the ``unstarted`` rows (tokens,
    in the order runners take them) goes to the GPU that frees up first."""
    left = [0.0 if row is None else max(0.0, row[1] - (now - row[0]) * rate) for row in taken]
    for tokens in unstarted:
        least = left.index(min(left))
        left[least] += tokens
    return left


def tail_row_tokens(waiting: int, budget: int, taken: list, unstarted, rate: float, now: float) -> int | None:
    """The size of a row for an idle GPU when the ``waiting`` tokens are the last of the work: None
    while a full row of ``budget`` per GPU (one ``taken`` entry each, as in ``gpu_loads``) waits,
    else sized so that every GPU ends together (water-filling over what the GPUs have left at
    ``rate``), at least a quarter of the budget (less is mostly fixed cost)."""
    if waiting >= len(taken) * budget:
        return None
    level = water_level(waiting, gpu_loads(taken, unstarted, rate, now))
    return min(budget, max(int(level), budget // 4))


def largest_first_by_group(window: list, head) -> list:
    """``window`` (the scheduler's queued items) largest first, except that a sequence sharing its
    first tokens with others (a GRPO group's prompt; ``QueuedSequence.group``) is followed at once by the
    rest of them, the head's own group leading: a row that takes one member then takes its mates while they fit, each
    costing only its own tokens, as offline packing keeps groups whole (``pack_groups_first_fit``).
    Without prefix sharing (no groups), plain largest first. Stable: equal lengths keep arrival order."""
    ordered = sorted(window, key=lambda it: -it.tokens)
    units: list[list] = []
    by_group: dict[bytes, list] = {}
    for item in ordered:
        if item.group is None:
            units.append([item])
        elif item.group in by_group:
            by_group[item.group].append(item)
        else:
            by_group[item.group] = [item]
            units.append(by_group[item.group])
    if not by_group:
        return ordered
    lead = by_group.get(head.group) if head.group is not None else None
    return [*(lead or ()), *(item for unit in units if unit is not lead for item in unit)]
