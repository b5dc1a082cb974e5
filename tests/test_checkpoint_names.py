"""The checkpoint package's public names: in their home, ``loco.checkpoint``, and where code
imported them before (``loco.config``, ``loco.training``); and the configuration, one layer
below the training job, loads none of it."""

import subprocess
import sys


def test_the_names_code_imported_before_are_the_package_s():
    import loco.config
    import loco.training
    from loco import checkpoint
    from loco.checkpoint import files, resume, staging, state

    assert loco.config.resume_config is checkpoint.resume_config is resume.resume_config
    assert loco.config.check_layout is checkpoint.check_layout is resume.check_layout
    assert loco.training.seek is state.seek and loco.training.shard_mesh is state.shard_mesh
    assert (checkpoint.read_worker, checkpoint.save_worker, checkpoint.load_worker,
            checkpoint.worker_dir, checkpoint.snapshot) == (
        files.read_worker, files.save_worker, files.load_worker, files.worker_dir,
        staging.snapshot)


def test_importing_the_configuration_loads_no_checkpoint_module():
    code = ("import sys, loco.config; "
            "print(sorted(m for m in sys.modules if m.startswith('loco.checkpoint')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
