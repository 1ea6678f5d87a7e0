"""`sandbox_isolation`: skips a test, naming what is missing, where the sandbox cannot isolate."""

import pytest

from titan_moe.rl.sandbox import SandboxUnavailable, isolation


@pytest.fixture
def sandbox_isolation() -> None:
    try:
        isolation()
    except SandboxUnavailable as e:
        pytest.skip(str(e))
