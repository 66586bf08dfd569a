"""Config: presets, validation messages, YAML loading."""

import dataclasses

import pytest

from gspo.config import ConfigError, TrainConfig
from gspo.config.yamlfile import load_yaml
from gspo.train.checkpoint import config_yaml
from gspo.train.resolve import resolve


def test_presets_fill_clip_ranges():
    assert (resolve(TrainConfig(algorithm="gspo")).clip_low,
            resolve(TrainConfig(algorithm="gspo")).clip_high) == (3e-4, 4e-4)
    grpo = resolve(TrainConfig(algorithm="grpo"))
    assert (grpo.clip_low, grpo.clip_high, grpo.beta) == (0.2, 0.27, 0.0)
    tok = resolve(TrainConfig(algorithm="gspo_token"))
    assert (tok.clip_low, tok.clip_high) == (3e-4, 4e-4)
    # an explicit value wins over the preset
    assert resolve(TrainConfig(algorithm="grpo", clip_high=0.28)).clip_high == 0.28


def test_paper_defaults():
    cfg = resolve(TrainConfig())
    assert cfg.algorithm == "gspo" and cfg.num_minibatches == 4 and cfg.beta == 0.0
    assert cfg.loss_agg == "seq-mean-token-mean"


@pytest.mark.parametrize("changes,field", [
    ({"group_size": 1}, "group_size"),
    ({"clip_low": -0.1}, "clip_low"),
    ({"clip_high": -1e-4}, "clip_high"),
    ({"clip_low": 1.5}, "clip_low"),
    ({"rollout_is_high": 0.9}, "rollout_is_high"),
    ({"rollout_is_low": 1.5}, "rollout_is_low"),
    ({"opsm_delta": -0.1}, "opsm_delta"),
    ({"sapo_tau_neg": 0.0}, "sapo_tau_neg"),
    ({"rollout_is": "token", "old_logp": "sampling"}, "old_logp"),
    ({"algorithm": "dpo"}, "algorithm"),
    ({"task": "chess"}, "task"),
    ({"prompts_per_step": 3, "group_size": 5, "num_minibatches": 4}, "num_minibatches"),
    ({"loss_agg": "sum"}, "loss_agg"),
    ({"temperature": 0.0}, "temperature"),
    ({"lr": 0.0}, "lr"),
    ({"epochs": 0}, "epochs"),
    ({"top_p": 1.5}, "top_p"),
])
def test_invalid_values_are_rejected_with_the_field_name(changes, field):
    with pytest.raises(ConfigError) as e:
        resolve(dataclasses.replace(TrainConfig(), **changes))
    msg = str(e.value)
    assert msg.startswith(field + ":") and "\n" not in msg


def test_minibatch_message_names_the_batch():
    with pytest.raises(ConfigError, match="= 15"):
        resolve(TrainConfig(prompts_per_step=3, group_size=5, num_minibatches=4))


def test_yaml_round_trip(tmp_path):
    cfg = resolve(TrainConfig(algorithm="grpo", steps=7, adam_betas=(0.8, 0.95), output_dir=str(tmp_path / "r")))
    (tmp_path / "c.yaml").write_text(config_yaml(cfg))
    assert load_yaml(tmp_path / "c.yaml") == cfg


def test_yaml_values_and_errors(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("algorithm: grpo\ngroup-size: 4\nlr: 1\nclip_low: null\n")
    cfg = load_yaml(p)
    assert (cfg.algorithm, cfg.group_size, cfg.lr, cfg.clip_low) == ("grpo", 4, 1.0, None)
    p.write_text("lr: 1e-5\nclip_high: 4e-4\n")  # YAML 1.1 reads these as strings; they are numbers
    cfg = load_yaml(p)
    assert (cfg.lr, cfg.clip_high) == (1e-5, 4e-4)
    cases = {
        "group_size: eight\n": "group_size: expected an integer, got 'eight'",
        "group_size: true\n": "group_size: expected an integer",
        "lr: fast\n": "lr: expected a number",
        "algorithm: ppo2\n": "algorithm: expected one of gspo, grpo, ppo, gspo_token",
        "bogus: 1\n": "unknown option 'bogus'",
        "- 1\n- 2\n": "expected a mapping",
        "adam_betas: [0.9]\n": "adam_betas: expected a list of 2 values",
        "a: [1\n": "not valid YAML",
    }
    for text, msg in cases.items():
        p.write_text(text)
        with pytest.raises(ConfigError) as e:
            load_yaml(p)
        assert msg in str(e.value) and str(p) in str(e.value), (text, str(e.value))
    with pytest.raises(ConfigError, match="no such config file"):
        load_yaml(tmp_path / "missing.yaml")


def test_successor_presets_and_corrections_resolve():
    # presets from the papers: CISPO no lower bound (1 - 1.0 = 0) and 1 + 0.28; GMPO ±0.4 in log space
    assert (resolve(TrainConfig(algorithm="cispo")).clip_low,
            resolve(TrainConfig(algorithm="cispo")).clip_high) == (1.0, 0.28)
    assert (resolve(TrainConfig(algorithm="gmpo")).clip_low,
            resolve(TrainConfig(algorithm="gmpo")).clip_high) == (0.4, 0.4)
    sapo = resolve(TrainConfig(algorithm="sapo"))
    assert (sapo.sapo_tau_pos, sapo.sapo_tau_neg) == (1.0, 1.05)
    assert resolve(TrainConfig(algorithm="gmpo", clip_low=2.0)).clip_low == 2.0  # log space: any range >= 0
    # the corrections need both log-probs: auto recomputes even where it would reuse the sampler's
    assert resolve(TrainConfig()).old_logp == "sampling"
    assert resolve(TrainConfig(rollout_is="token")).old_logp == "recompute"
    assert resolve(TrainConfig(opsm_delta=0.01)).old_logp == "recompute"


def test_sections_are_handed_whole_and_options_read_by_name():
    from gspo.config import SECTION_OF, Loss, Sampling

    cfg = TrainConfig(loss=Loss(algorithm="grpo"), group_size=4)  # a section and an option by name
    assert (cfg.loss.algorithm, cfg.sampling.group_size, cfg.group_size) == ("grpo", 4, 4)
    cfg.group_size = 6  # set by name: the section's field
    assert cfg.sampling.group_size == 6 and SECTION_OF["group_size"] == "sampling"
    given = Sampling(group_size=3)
    made = TrainConfig(sampling=given)
    made.group_size = 5
    assert given.group_size == 3  # a section given is copied, never shared
    copy = dataclasses.replace(cfg, steps=7)  # dataclasses.replace takes option names too
    assert (copy.steps, cfg.steps, copy.group_size) == (7, None, 6)
    copy.temperature = 0.5
    assert cfg.temperature == 1.0  # the copy's sections are its own
    with pytest.raises(TypeError, match="unexpected option 'gruop_size'"):
        TrainConfig(gruop_size=4)
    with pytest.raises(AttributeError, match="no option 'gruop_size'"):
        _ = cfg.gruop_size


def test_every_option_is_declared_once_with_its_facts():
    from gspo.config import RESUME_SAFE, options, to_dict

    fields = options()
    # unique across sections: flat flags and keys (107, then vllm-server's 7)
    assert len({f.name for f in fields}) == len(fields) == 126  # 124, then --cuda-graphs and --malloc-heap
    assert all(f.metadata["help"].strip() for f in fields)
    assert list(to_dict(TrainConfig())) == [f.name for f in fields]  # config.yaml: section by section
    assert {"steps", "device", "save_every", "vllm_sleep"} <= set(RESUME_SAFE) and "lr" not in RESUME_SAFE


@pytest.mark.parametrize("changes, message", [
    ({"prompts_per_step": 0}, "prompts_per_step: must be >= 1 (got 0)"),          # ge=1
    ({"temperature": 0.0}, "temperature: must be > 0 (got 0.0)"),                 # gt=0
    ({"top_p": 1.5}, "top_p: must be in (0, 1] (got 1.5)"),                       # gt=0, le=1
    ({"lora_dropout": 1.0}, "lora_dropout: must be in [0, 1) (got 1.0)"),         # ge=0, lt=1
    ({"gamma": -0.1}, "gamma: must be in [0, 1] (got -0.1)"),                     # ge=0, le=1
    ({"critic_lr": None}, None),                                                  # None passes a bound
])
def test_bounds_come_from_the_option_and_say_which(changes, message):
    if message is None:
        resolve(TrainConfig(**changes))
        return
    with pytest.raises(ConfigError) as e:
        resolve(TrainConfig(**changes))
    assert str(e.value) == message


def test_the_flags_stay_flat_and_group_by_section():
    from gspo.commands.argv import parse

    cfg = parse(TrainConfig, ["--group-size", "4", "--clip-low", "0.1", "--no-progress", "--stop-token", "a", "b"],
                "gspo train")
    assert (cfg.sampling.group_size, cfg.loss.clip_low, cfg.run.progress, cfg.sampling.stop_token) == \
        (4, 0.1, False, ("a", "b"))
