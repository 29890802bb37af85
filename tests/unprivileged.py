"""Running a command as a user without privileges: root reads and writes any file, so a test of
what another user's permissions refuse drops to nobody where the tests run as root."""

import os
import shutil

import pytest


def unprivileged() -> list[str]:
    """The argv prefix that runs a command as nobody when the tests run as root ([] otherwise);
    skips the test where root has no ``setpriv`` (util-linux) to drop to nobody with."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("run as root without setpriv: no unprivileged user to run as")
    return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
