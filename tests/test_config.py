"""Config files and --set overrides: defaults, strict keys and types, errors that say where."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from pytrain.config import SECTIONS, Config, ConfigError, describe, load_config, mask_for

ROOT = Path(__file__).resolve().parent.parent

MINIMAL = """\
[model]
path = "m.gguf"

[data]
train = "data/train.jsonl"
"""


def write(tmp_path: Path, text: str, name: str = "run.toml") -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def test_defaults_and_paths_relative_to_the_config_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sub = tmp_path / "cfgs"
    sub.mkdir()
    cfg = load_config(write(sub, MINIMAL))
    assert cfg.model.path == str(sub / "m.gguf")
    assert cfg.data.train == str(sub / "data" / "train.jsonl")
    assert cfg.data.validation is None
    assert (cfg.model.device, cfg.model.threads, cfg.model.type_policy) == ("auto", None, "auto")
    d = cfg.data
    assert (d.split, d.format, d.max_seq_len, d.truncation, d.packing, d.mask, d.on_error) == \
        (0.0, "auto", 1024, "right", False, None, "stop")
    lo = cfg.lora
    assert (lo.rank, lo.alpha, lo.dropout, lo.skip_ssm, lo.init) == (16, 32.0, 0.0, True, "peft")
    assert lo.targets is None           # the architecture's default, chosen when the model loads
    t = cfg.train
    assert (t.epochs, t.max_steps, t.batch_size, t.grad_accum, t.lr, t.warmup) == \
        (1, None, 4, 1, 1e-4, 0)
    assert (t.weight_decay, t.max_grad_norm, t.seed, t.eval_every, t.save_every) == \
        (0.0, 1.0, 0, 0, 0)
    assert (t.adam_beta1, t.adam_beta2, t.adam_eps, t.loss_bug_repro) == (0.9, 0.999, 1e-8, False)
    assert cfg.output.formats == ["gguf"] and cfg.output.keep_checkpoints == 3
    # unset output dir: runs/<config name> under the working directory
    assert cfg.output.dir == str(tmp_path / "runs" / "run")
    # unset seeds follow train.seed and are stored resolved
    assert d.shuffle_seed == 0 and lo.seed == 0
    cfg = load_config(write(sub, MINIMAL + "[train]\nseed = 7\n"))
    assert cfg.data.shuffle_seed == 7 and cfg.lora.seed == 7


def test_mask_default_follows_format():
    d = Config().data
    assert mask_for("chat", d.mask) == "assistant_only"
    assert mask_for("completion", d.mask) == "completion_only"
    assert mask_for("text", d.mask) == "all"
    d.mask = "all"
    assert mask_for("chat", d.mask) == "all"


def test_unknown_key_names_key_file_and_line(tmp_path):
    p = write(tmp_path, MINIMAL + "\n[train]\nbatch_size = 2\nlearning_rate = 1e-4\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert f"{p}:9: train.learning_rate: unknown key" in msg
    assert "lr" in msg  # lists the valid keys


def test_unknown_section_and_non_table(tmp_path):
    p = write(tmp_path, MINIMAL + "\n[optim]\nlr = 1\n")
    with pytest.raises(ConfigError, match=rf"{p}:7: optim: unknown section"):
        load_config(p)
    p = write(tmp_path, "train = 3\n" + MINIMAL)
    with pytest.raises(ConfigError, match=rf"{p}:1: train: expected a table"):
        load_config(p)


@pytest.mark.parametrize("line, key, what", [
    ('lr = "1e-4"', "train.lr", "expected a number, got str"),
    ("batch_size = 2.5", "train.batch_size", "expected an integer, got float"),
    ("batch_size = true", "train.batch_size", "expected an integer, got bool"),
    ("epochs = 0", "train.epochs", "must be > 0"),
    ('schedule = "exp"', "train.schedule", "'exp' is not one of"),
    ("loss_bug_repro = 1", "train.loss_bug_repro", "expected true or false"),
    ("max_grad_norm = -1.0", "train.max_grad_norm", "must be >= 0"),
])
def test_wrong_type_or_value_names_key_file_and_line(tmp_path, line, key, what):
    p = write(tmp_path, MINIMAL + "\n[train]\nseed = 1\n" + line + "\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(e.value).startswith(f"{p}:9: {key}: {what}")


def test_dotted_keys_are_located_too(tmp_path):
    p = write(tmp_path, 'model.path = "m.gguf"\ndata.train = "t.jsonl"\nlora.rank = "8"\n')
    with pytest.raises(ConfigError, match=rf"{p}:3: lora.rank: expected an integer"):
        load_config(p)


def test_list_types(tmp_path):
    p = write(tmp_path, MINIMAL + "[lora]\ntargets = [1, 2]\n")
    with pytest.raises(ConfigError, match=r"lora.targets: expected a string"):
        load_config(p)
    p = write(tmp_path, MINIMAL + '[lora]\ntargets = ["attn_q", " ", "attn_q.weight"]\n')
    with pytest.raises(ConfigError, match=rf"{p}:7: lora.targets: empty name"):
        load_config(p)
    # names are the architecture's, checked when the model loads; errors then still say where
    p = write(tmp_path, MINIMAL + '[lora]\ntargets = ["attn_q", "mlp", "attn_q.weight"]\n')
    cfg = load_config(p, ["train.lr=0.1"])
    assert cfg.lora.targets == ["attn_q", "mlp"]
    assert str(cfg.error("lora", "targets", "no 'mlp'")) == f"{p}:7: lora.targets: no 'mlp'"
    assert str(cfg.error("train", "lr", "too big")) == "--set train.lr=0.1: train.lr: too big"
    assert str(cfg.error("train", "seed", "x")).startswith(f"{p.resolve()}: train.seed: ")
    p = write(tmp_path, MINIMAL + '[output]\nformats = ["gguf", "onnx"]\n')
    with pytest.raises(ConfigError, match=r"output.formats: 'onnx' is not an adapter format"):
        load_config(p)


def test_toml_syntax_error_has_the_line(tmp_path):
    p = write(tmp_path, MINIMAL + "[train]\nlr = = 3\n")
    with pytest.raises(ConfigError, match=rf"{p}:7: invalid TOML"):
        load_config(p)


def test_missing_file_and_required_keys(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "nope.toml")
    p = write(tmp_path, '[model]\npath = "m.gguf"\n')
    with pytest.raises(ConfigError, match=r"data.train: required key missing"):
        load_config(p)
    assert load_config(p, partial=True).data.train is None


def test_cross_field_checks(tmp_path):
    p = write(tmp_path, MINIMAL + 'validation = "v.jsonl"\nsplit = 0.1\n')
    with pytest.raises(ConfigError, match=rf"{p}:7: data.split: .*only taken when"):
        load_config(p)
    p = write(tmp_path, MINIMAL + 'format = "text"\nmask = "assistant_only"\n')
    with pytest.raises(ConfigError, match=r"data.mask: 'assistant_only' does not apply to "
                                          r"format 'text'"):
        load_config(p)
    # with format auto the mask is checked per file, at load time
    assert load_config(write(tmp_path, MINIMAL + 'mask = "completion_only"\n')).data.mask == \
        "completion_only"


def test_overrides(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sub = tmp_path / "c"
    sub.mkdir()
    p = write(sub, MINIMAL + '[train]\nlr = 1e-3\n')
    cfg = load_config(p, ["train.lr=2e-5", "train.max_steps=10", "data.packing=true",
                          'lora.targets=["attn_q", "attn_v"]', "output.formats=gguf,peft",
                          "data.train=other.jsonl", "model.device=cpu", "data.validation=v.jsonl"])
    assert cfg.train.lr == 2e-5 and cfg.train.max_steps == 10 and cfg.data.packing is True
    assert cfg.lora.targets == ["attn_q", "attn_v"]
    assert cfg.output.formats == ["gguf", "peft"]
    assert cfg.model.device == "cpu"  # bare string fallback
    # override paths are relative to the working directory, file paths to the file
    assert cfg.data.train == str(tmp_path / "other.jsonl")
    assert cfg.model.path == str(sub / "m.gguf")
    assert cfg.train.lr == 2e-5
    # int for a float is fine; "none" unsets an optional value
    cfg = load_config(p, ["train.lr=1", "data.validation=v.jsonl", "data.validation=none"])
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.data.validation is None
    # no file at all: defaults plus overrides
    cfg = load_config(None, ["model.path=m.gguf", "data.train=t.jsonl"])
    assert cfg.model.path == str(tmp_path / "m.gguf") and cfg.source is None


@pytest.mark.parametrize("item, match", [
    ("train.lr=fast", r"--set train.lr=fast: train.lr: expected a number, got str 'fast'"),
    ("train.learning_rate=1", r"--set train.learning_rate=1: train.learning_rate: unknown key"),
    ("optim.lr=1", r"--set optim.lr=1: optim: unknown section"),
    ("lr=1", r"--set lr=1: expected section.key=value"),
    ("train.lr", r"expected section.key=value"),
    ("train.batch_size=0", r"--set train.batch_size=0: train.batch_size: must be > 0"),
])
def test_override_errors_name_the_override(tmp_path, item, match):
    with pytest.raises(ConfigError, match=match):
        load_config(write(tmp_path, MINIMAL), [item])


def test_round_trip_through_toml(tmp_path):
    p = write(tmp_path, MINIMAL + '[train]\nmax_steps = 5\nschedule = "cosine"\n'
                                  '[lora]\ntargets = ["attn_q", "attn_output"]\n')
    cfg = load_config(p)
    assert cfg.lora.targets == ["attn_q", "attn_output"]
    saved = write(tmp_path / "", cfg.to_toml(), "saved.toml")
    again = load_config(saved)
    assert again == cfg
    d = cfg.to_dict()
    assert set(d) == set(SECTIONS) and d["train"]["max_steps"] == 5
    assert d["data"]["validation"] is None
    d["lora"]["targets"].append("x")  # a copy, not the config's own list
    assert cfg.lora.targets == ["attn_q", "attn_output"]


def test_every_field_has_help():
    text = describe()
    for section, cls in SECTIONS.items():
        assert f"[{section}]" in text
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{section}.{f.name} has no help text"
            assert f"  {f.name} (" in text
    assert "pad labels trained" in text  # loss_bug_repro says what it breaks


@pytest.mark.parametrize("name", ["demo.toml", "qwen35-2b.toml"])
def test_example_configs_load(name):
    cfg = load_config(ROOT / "config" / name)
    assert cfg.data.format == "chat" and cfg.lora.skip_ssm
    assert cfg.lora.targets == ["attn_q", "attn_k", "attn_v", "attn_output"]
    if name == "demo.toml":
        assert cfg.model.path == str(ROOT / "pytrain" / "assets" / "default-model.gguf")
        assert (cfg.lora.rank, cfg.lora.alpha, cfg.train.lr) == (16, 32.0, 5e-3)
        assert cfg.train.schedule == "constant" and cfg.train.eval_every == 50
    else:
        assert (cfg.lora.rank, cfg.lora.alpha, cfg.train.lr, cfg.train.epochs) == \
            (16, 32.0, 1e-6, 3)
        assert cfg.train.loss_bug_repro is False


@pytest.mark.parametrize("item, hint", [
    ("train.max_step=3", "did you mean `max_steps`?"),          # a typo: difflib
    ("train.learning_rate=1e-4", "did you mean `lr`?"),         # the transformers name
    ("lora.lora_alpha=8", "did you mean `alpha`?"),
    ("data.max_length=64", "did you mean `max_seq_len`?"),
    ("trian.lr=1", "did you mean `train`?"),                   # a section
    ("train.zzz=1", None),
])
def test_an_unknown_key_close_to_a_known_one_is_suggested(tmp_path, item, hint):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, MINIMAL), [item])
    msg = str(e.value)
    assert ("did you mean" not in msg) if hint is None else (hint in msg), msg
    assert "valid " in msg                      # the full list is still given


PATH_KEYS = [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)
             if f.metadata.get("path")]


def test_the_path_keys_are_the_ones_refusing_an_empty_value():
    assert PATH_KEYS == ["model.path", "data.train", "data.validation", "data.chat_template",
                         "output.dir"]


@pytest.mark.parametrize("key", PATH_KEYS)
def test_an_empty_path_is_refused_not_read_as_the_working_folder(tmp_path, monkeypatch, key):
    """An empty path resolves to the folder it is relative to: a data key then read every
    Parquet file below the working directory.  Refused wherever it is given, with the way to
    unset an optional key."""
    monkeypatch.chdir(tmp_path)
    p = write(tmp_path, MINIMAL)
    optional = key not in ("model.path", "data.train")
    for given, where in ([f"{key}="], f"--set {key}=: "), ([f'{key}=""'], f'--set {key}="": '), \
            ([f"{key}=  "], f"--set {key}=  : "), ({key: ""}, f"overrides['{key}']: "):
        with pytest.raises(ConfigError) as e:
            load_config(p, given)
        assert str(e.value).startswith(f"{where}{key}: an empty path"), str(e.value)
        assert ('"none" unsets it' in str(e.value)) is optional
    tables = {"model": {"path": "m.gguf"}, "data": {"train": "t.jsonl"}}
    section, name = key.split(".")
    tables.setdefault(section, {})[name] = ""
    f = write(tmp_path, "".join(f"[{s}]\n" + "".join(f'{k} = "{v}"\n' for k, v in t.items())
                                for s, t in tables.items()), "empty.toml")
    with pytest.raises(ConfigError, match=rf"^{f}:\d+: {key}: an empty path"):
        load_config(f)


def test_the_command_refuses_an_empty_data_path(tmp_path, monkeypatch, capsys):
    from pytrain.cli import main
    monkeypatch.chdir(tmp_path)
    rc = main(["train", str(ROOT / "config" / "demo.toml"), "--no-progress", "--set",
               f"output.dir={tmp_path / 'out'}", "--set", "data.validation="])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("error: --set data.validation=: data.validation: an "
                                      "empty path"), err


LIST_KEYS = [f"{s}.{f.name}" for s, cls in SECTIONS.items()
             for f in dataclasses.fields(cls) if "list[" in str(cls.__annotations__[f.name])]


def test_the_list_keys():
    assert LIST_KEYS == ["lora.targets", "train.sample_prompts", "output.formats"]


@pytest.mark.parametrize("key, value", [("lora.targets", "attn_q"),
                                        ("train.sample_prompts", "What does the cow say?"),
                                        ("output.formats", "peft")])
def test_a_string_for_a_list_key_is_a_type_error(tmp_path, key, value):
    """A TOML string is not a list: ``targets = "attn_q"`` is refused naming the key and the
    line, as any wrong type is; the list form is taken as written."""
    section, name = key.split(".")
    p = write(tmp_path, MINIMAL + f'\n[{section}]\n{name} = "{value}"\n')
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(e.value).startswith(f"{p}:8: {key}: expected a list of strings, got str "
                                   f"{value!r}"), str(e.value)
    assert f'["{value}"]' in str(e.value)             # says how to write it
    cfg = load_config(write(tmp_path, MINIMAL + f'\n[{section}]\n{name} = ["{value}"]\n'))
    assert getattr(getattr(cfg, section), name) == [value]
    with pytest.raises(ConfigError, match=rf"^overrides\['{key}'\]: {key}: expected a list"):
        load_config(p.parent / "run.toml", {key: value})            # Python: no parsing
    # a TOML string on the command line is a string there too
    with pytest.raises(ConfigError, match="^" + re.escape(f'--set {key}="{value}": {key}: '
                                                         f'expected a list')):
        load_config(write(tmp_path, MINIMAL, "ok.toml"), [f'{key}="{value}"'])


def test_a_bare_word_on_the_command_line_gives_a_list(tmp_path):
    """``--set`` values that are no TOML literal are taken as text: for a list of names
    (targets, formats) the names, separated by commas or spaces; for the sample prompts one
    prompt, whose spaces and commas are its own."""
    p = write(tmp_path, MINIMAL)
    cfg = load_config(p, ["lora.targets=attn_q,attn_v", "output.formats=gguf peft",
                          "train.sample_prompts=Hello, who are you?"])
    assert cfg.lora.targets == ["attn_q", "attn_v"] and cfg.output.formats == ["gguf", "peft"]
    assert cfg.train.sample_prompts == ["Hello, who are you?"]
    cfg = load_config(p, ["lora.targets=attn_q", 'train.sample_prompts=["a b", "c"]',
                          "output.formats=peft"])
    assert cfg.lora.targets == ["attn_q"] and cfg.train.sample_prompts == ["a b", "c"]
    assert cfg.output.formats == ["peft"]
    cfg = load_config(p, ["lora.targets=attn_q", "lora.targets=none", "train.sample_prompts=none"])
    assert cfg.lora.targets is None and cfg.train.sample_prompts is None
