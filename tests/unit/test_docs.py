from pathlib import Path

from gpulab.hub.cli import build_parser
from gpulab.hub.cli.docs import MARK_END, MARK_START, config_reference


def test_readme_config_reference_matches_the_code():
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    embedded = readme[readme.index(MARK_START) + len(MARK_START): readme.index(MARK_END)]
    assert embedded.strip() == config_reference(build_parser()).strip(), (
        "README's configuration reference is stale: regenerate it with `gpulab config-reference`"
    )
