"""What a run directory records before step 0 keeps secrets from other users: with an admin token, configs/
is its owner's alone and the overrides and argv show <redacted>."""

import json
import stat

from asyncrl.config.compose import compose_config
from asyncrl.paths import RunDir
from asyncrl.utils.meta import redacted, write_run_files


def test_the_admin_token_stays_with_the_runs_owner(tmp_path):
    secret = "s3cret-token"
    overrides = [f"inference.admin_token={secret}", "max_steps=2"]
    run = RunDir(tmp_path / "with").create()
    write_run_files(run, compose_config(overrides), overrides)
    assert stat.S_IMODE(run.configs.stat().st_mode) == 0o700  # the processes read the token from config.yaml
    assert secret in run.config_file.read_text()
    assert secret not in run.overrides_file.read_text() and "<redacted>" in run.overrides_file.read_text()
    assert (
        redacted(["asyncrl", "rl", f"+inference.admin_token={secret}"])[-1]
        == "+inference.admin_token=<redacted>"
    )
    assert secret not in json.dumps(json.loads(run.meta_file.read_text()))
    plain = RunDir(tmp_path / "without").create()
    write_run_files(plain, compose_config(["max_steps=2"]), ["max_steps=2"])
    assert stat.S_IMODE(plain.configs.stat().st_mode) != 0o700  # nothing secret: left as the umask makes it
