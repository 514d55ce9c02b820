"""One server that the ``nemo-gym`` 0.7.0 wheel ships (an environment server, an agent, a
resources server), run as is from a NeMo Gym global config, for ``bench/nemo_gym_pypi.py``'s
environment-server part. Run under the Python of ``.venv-nemo-gym-0.7``:

    python env_servers.py --config global.json --name single_agent_turn_env

``global.json`` is the global config NeMo Gym's ``ng_run`` would hand its servers (top-level
instance names -> ``{<server type>: {<implementation>: {host, port, ...}}}``). The instance
``--name`` names is built from its implementation's ``app.py`` (the ``SimpleServer`` subclass
defined there) and its own config model, with a ``ServerClient`` over that global config: the
servers find each other by name, as under ``ng_run``, without a head server. The model server
the agent calls is streamrl's rollout worker (its policy endpoint): the global config only
needs its host and port.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os

import uvicorn
from nemo_gym.config_types import BaseServerConfig
from nemo_gym.server_utils import ServerClient, SimpleServer
from omegaconf import OmegaConf


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--name", required=True)
    args = ap.parse_args()
    with open(args.config) as f:
        global_config = json.load(f)
    # what ng_run hands a child server: its HTTP client reads the global config from here
    os.environ["NEMO_GYM_CONFIG_DICT"] = json.dumps(global_config)
    ((kind, impls),) = global_config[args.name].items()
    ((impl, settings),) = impls.items()
    module = importlib.import_module(f"{kind}.{impl}.app")
    classes = [
        c
        for _, c in inspect.getmembers(module, inspect.isclass)
        if issubclass(c, SimpleServer) and c.__module__ == module.__name__
    ]
    (cls,) = [c for c in classes if not any(issubclass(o, c) and o is not c for o in classes)]
    config_cls = cls.model_fields["config"].annotation
    config = config_cls.model_validate({**settings, "name": args.name})
    client = ServerClient(
        head_server_config=BaseServerConfig(host="127.0.0.1", port=0),
        global_config_dict=OmegaConf.create(global_config),
    )
    app = cls(config=config, server_client=client).setup_webserver()
    uvicorn.run(app, host=settings["host"], port=settings["port"], log_level="warning",
                access_log=False)  # fmt: skip


if __name__ == "__main__":
    main()
