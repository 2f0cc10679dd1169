"""Config errors are caught before any process group exists, naming the key."""

import pytest

from titan_mok import registry
from titan_mok.config_check import ConfigError, MokConfigManager

DEBUG = "train_configs/kimi_k2_7_code/debug.toml"


@pytest.fixture(autouse=True)
def _registered(monkeypatch):
    registry.register_all()
    monkeypatch.setenv("WORLD_SIZE", "2")


def parse(*args: str, config: str = DEBUG):
    return MokConfigManager().parse_args(["--job.config_file", config, *args])


def write_toml(tmp_path, extra: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(open(DEBUG).read() + "\n" + extra)
    return str(path)


def test_debug_config_parses():
    config = parse()
    assert config.mok.backend == "mok" and config.parallelism.expert_parallel_degree == 2


def test_retired_weight_cache_key_says_it_is_always_on(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(open(DEBUG).read().replace('precision = "bf16"', 'precision = "mxfp8"\nmxfp8_weight_cache = true'))
    with pytest.raises(ConfigError, match=r"\[mok\] mxfp8_weight_cache is retired: precision = 'mxfp8' always "
                                          r"quantizes each routed-expert weight once per optimizer step"):
        parse(config=str(path))


@pytest.mark.parametrize(
    "extra, message",
    [
        ("[kittens]\ncount = 3", r"unknown section \[kittens\]"),
        ("[checkpoint]\nintervall = 3", r"\[checkpoint\] unknown key 'intervall'"),
        ("[comm]\ninit_timeout_seconds = \"ten\"", r"\[comm\] init_timeout_seconds = 'ten': expected a value of type int"),
    ],
)
def test_toml_errors_name_the_key(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        parse(config=write_toml(tmp_path, extra))


def test_wrong_literal_in_toml(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(open(DEBUG).read().replace('precision = "bf16"', 'precision = "fp4"'))
    with pytest.raises(ConfigError, match=r"\[mok\] precision = 'fp4': expected one of 'bf16', 'mxfp8'"):
        parse(config=str(path))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model.name", "llama9"], r"\[model\] name = 'llama9': choose one of"),
        (["--model.flavor", "huge"], r"\[model\] flavor = 'huge' for kimi_k2_7_code: choose one of"),
        (["--parallelism.expert_parallel_degree", "3"], r"expert_parallel_degree = 3 does not divide the world size 2"),
        (["--parallelism.expert_parallel_degree", "0"], r"expert_parallel_degree = 0: must be >= 1"),
        (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
         r"selective_ac_option = 'op' fails"),
        (["--mok.kernels", "triton"], r"\[mok\] kernels = 'triton' needs a CUDA GPU"),
        # EP 2 (the debug config's) passes: the megakernel runs expert-parallel; the next check is the device's
        (["--mok.kernels", "megakernel"], r"\[mok\] kernels = 'megakernel' needs a CUDA GPU"),
        # MXFP8 passes too: the megakernel runs it; again the device's check
        (["--mok.kernels", "megakernel", "--mok.precision", "mxfp8"],
         r"\[mok\] kernels = 'megakernel' needs a CUDA GPU"),
        (["--mok.kernels", "megakernel", "--parallelism.expert_parallel_degree", "1"],
         r"\[mok\] kernels = 'megakernel' needs a CUDA GPU"),
        (["--parallelism.tensor_parallel_degree", "2"], r"\[parallelism\] tensor_parallel_degree = 2: titan-mok's models support FSDP/HSDP and EP only"),
        (["--parallelism.pipeline_parallel_degree", "2"], r"\[parallelism\] pipeline_parallel_degree = 2: titan-mok's models support"),
        (["--checkpoint.last_save_in_hf"], r"\[checkpoint\] last_save_in_hf = true saves the model only: set last_save_model_only"),
        (["--comm.train_timeout_seconds", "0"], r"\[comm\] train_timeout_seconds = 0: must be > 0"),
        (["--debug.fault_nonfinite_step", "-1"], r"\[debug\] fault_nonfinite_step = -1: must be >= 0"),
        (["--debug.fault_nonfinite_step", "3", "--debug.fault_nonfinite_rank", "2"],
         r"\[debug\] fault_nonfinite_rank = 2: must be in \[0, 2\)"),
    ],
)
def test_job_errors_name_the_key(args, message):
    with pytest.raises(ConfigError, match=message):
        parse(*args)


def test_fault_keys_defaults():
    config = parse()
    assert config.checkpoint.last_save_model_only is False  # titan-mok's default: the last checkpoint continues
    assert config.checkpoint.checksums is True and config.training.nonfinite == "stop"
    assert config.debug.fault_nonfinite_step == 0


def test_ep_must_divide_expert_count(monkeypatch):
    experts = registry.flavors("kimi_k2_7_code")["debug"].moe_args.num_experts
    ep = next(d for d in range(2, 64) if experts % d)
    monkeypatch.setenv("WORLD_SIZE", str(ep))
    with pytest.raises(ConfigError, match=f"expert_parallel_degree = {ep} does not divide kimi_k2_7_code debug's {experts} experts"):
        parse("--parallelism.expert_parallel_degree", str(ep))


def test_cli_choice_out_of_range_is_rejected():
    # tyro checks Literal choices on the command line before our checks run.
    with pytest.raises(SystemExit):
        parse("--mok.backend", "deepep")


def test_train_entry_reports_config_error():
    from tests import torchrun

    code, out = torchrun.run("titan_mok.train", DEBUG, "--model.flavor", "huge", nproc=1, check=False, timeout=120)
    assert code != 0 and "config error: [model] flavor = 'huge'" in out


def test_baseline_model_is_checked_without_the_mok_section():
    """TorchTitan's own deepseek_v3 at Kimi's flavors (titan_mok.baseline): its flavors and the
    parallel degrees are checked; [mok] configures titan-mok's MoE layers only, so it is not."""
    config = parse("--model.name", registry.BASELINE_MODEL, "--mok.kernels", "triton")
    assert config.model.name == registry.BASELINE_MODEL
    with pytest.raises(ConfigError, match=rf"\[model\] flavor = 'huge' for {registry.BASELINE_MODEL}: choose one of"):
        parse("--model.name", registry.BASELINE_MODEL, "--model.flavor", "huge")
    with pytest.raises(ConfigError, match="expert_parallel_degree = 3 does not divide the world size 2"):
        parse("--model.name", registry.BASELINE_MODEL, "--parallelism.expert_parallel_degree", "3")
