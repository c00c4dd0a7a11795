"""docs/deploy-kubernetes.md matches the code: the files it names exist, its YAML and Python
parse, the values it names are in helm-values/values.yaml, its login examples name real
authenticator settings and pass the chart's schema, and its `gpulab` commands parse."""

import re
import shlex
from pathlib import Path

import pytest
import yaml
from oauthenticator.generic import GenericOAuthenticator
from oauthenticator.github import GitHubOAuthenticator

from gpulab.hub.cli import build_parser

from .test_helm_values import Z2JH, helm_merge, schema_errors

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "deploy-kubernetes.md").read_text()


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC, flags=re.S)


@pytest.fixture(scope="module")
def values():
    return yaml.safe_load((ROOT / "helm-values" / "values.yaml").read_text())


@pytest.fixture(scope="module")
def chart_defaults():
    return yaml.safe_load((Z2JH / "values.yaml").read_text())


def test_named_files_exist():
    named = set(re.findall(r"`((?:helm-values|images|tests|hub|spawner|extensions|scripts)/"
                           r"[A-Za-z0-9_./-]+)`", DOC))
    assert "helm-values/values.yaml" in named
    assert [p for p in named if not (ROOT / p).exists()] == []


def test_named_values_exist(values, chart_defaults):
    merged = helm_merge(chart_defaults, values)
    for path in set(re.findall(r"`((?:hub|singleuser|custom|cull|scheduling|proxy)\.[\w.-]+)`",
                               DOC)):
        node = merged
        for key in path.split("."):
            assert isinstance(node, dict) and key in node, f"{path} is not in the values"
            node = node[key]


def test_code_blocks_parse():
    assert blocks("yaml") and blocks("python")
    for text in blocks("yaml"):
        doc = yaml.safe_load(text)
        for snippet in (doc or {}).get("hub", {}).get("extraConfig", {}).values():
            compile(snippet, "extraConfig", "exec")
    for text in blocks("python"):
        compile(text, "docs", "exec")


@pytest.mark.parametrize("marker, cls", [("# helm-values/values.yaml\nhub:", GenericOAuthenticator),
                                         ("authenticator_class: github", GitHubOAuthenticator)],
                         ids=["dex", "github"])
def test_login_examples_are_real_settings_and_pass_the_schema(marker, cls, values, chart_defaults):
    [text] = [t for t in blocks("yaml") if marker in t]
    example = yaml.safe_load(text)
    section = example["hub"]["config"][cls.__name__]
    unknown = set(section) - set(cls.class_traits(config=True))
    assert not unknown, unknown
    merged = helm_merge(chart_defaults, helm_merge(values, example))
    assert schema_errors(yaml.safe_load((Z2JH / "values.schema.yaml").read_text()), merged) == []


def test_gpulab_commands_parse():
    commands = [line.strip() for text in blocks("sh") for line in text.splitlines()
                if line.strip().startswith("gpulab ")]
    assert any(c.startswith("gpulab quota set --group") for c in commands)
    parser = build_parser()
    for command in commands:
        words = shlex.split(command.split("#")[0])
        parser.parse_args(words[1:])  # SystemExit on an unknown option
