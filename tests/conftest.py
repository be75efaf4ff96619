import os
import sys

# Let tests import the harness (tests/ranks.py) and helpers by module name.
sys.path.insert(0, os.path.dirname(__file__))


import pytest  # noqa: E402

# Shipped configs that read files a demo makes first (runs/chat-demo/...): validated in a folder
# holding those files (tests/chat_data.py make_chat_demo_inputs).
CHAT_DEMO_CONFIGS = ("chat-demo-base", "finetune")


@pytest.fixture(scope="session")
def chat_demo_folder(tmp_path_factory):
    from chat_data import make_chat_demo_inputs

    return make_chat_demo_inputs(tmp_path_factory.mktemp("chat_demo"))


@pytest.fixture
def in_config_folder(request, monkeypatch):
    """Run a shipped-config test from a folder where the config's inputs exist."""
    def enter(path):
        if path.stem in CHAT_DEMO_CONFIGS:
            monkeypatch.chdir(request.getfixturevalue("chat_demo_folder"))
    return enter
