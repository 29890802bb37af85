"""Counts in log lines and messages, read right for one: "1 id", "2 ids", "0 ids"."""


def counted(count: int, noun: str) -> str:
    """``count`` ``noun``s, the noun in the singular for 1 (a regular plural: ``noun`` + "s")."""
    return f"{count} {noun}{'' if count == 1 else 's'}"
