"""deploy/ is valid and honest: the compose file against the Compose spec's JSON schema, the Kubernetes
manifests against kubernetes-validate's bundled schemas (offline), and both against the code: every
command is a `fulmen` subcommand whose flags parse, every FULMEN_* name is a field of some service's settings, every
Procfile service is deployed. Docker and a cluster are not available here; these checks are what we
can know without them."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import typer.main
import yaml
from packaging.requirements import Requirement

from fulmen.cli import main as cli
from fulmen.settings import known_env_names

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
K8S = DEPLOY / "k8s"
# The oldest Kubernetes the manifests target; kubernetes-validate bundles its schemas (no network).
K8S_VERSION = "1.30.0"
# Not Fulmen services: they run third-party images.
THIRD_PARTY = {"redis", "jaeger"}
FULMEN_NAME = re.compile(r"\bFULMEN_[A-Z0-9_]+\b")


# --- helpers --------------------------------------------------------------------------------------


_VARIABLE = re.compile(r"\$(?:\$|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\})")


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose's variable syntax (``${X}``, ``${X:-default}``, ``${X-default}``, ``${X:?error}``,
    ``$$``), applied as `docker compose` does before it validates the file against the schema."""

    def substitute(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group("name"), m.group("op"), m.group("arg")
        value = env.get(name)
        if op == ":-":
            return value or arg
        if op == "-":
            return arg if value is None else value
        if op in (":?", "?") and (value is None or (op == ":?" and not value)):
            raise KeyError(f"{name}: {arg}")
        if value is None:
            raise KeyError(f"{name} is unset and has no default")
        return value

    return _VARIABLE.sub(substitute, text)


def compose(**env: str) -> dict[str, Any]:
    """The compose file as docker compose would load it with ``env`` as the shell's environment."""
    loaded: dict[str, Any] = yaml.safe_load(interpolate(COMPOSE.read_text(), {"REDIS_PASSWORD": "s3cret", **env}))
    return loaded


def k8s_documents() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield path, doc


def k8s_objects(kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for _, doc in k8s_documents() if doc["kind"] == kind}


def procfile() -> dict[str, list[str]]:
    """Procfile process name -> its command line, split."""
    processes = {}
    for line in (REPO / "Procfile").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, command = line.split(":", 1)
            processes[name.strip()] = shlex.split(command)
    return processes


def fulmen_services_in_compose() -> dict[str, dict[str, Any]]:
    return {name: s for name, s in compose()["services"].items() if name not in THIRD_PARTY}


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def settings_env_names() -> set[str]:
    return known_env_names()


@pytest.fixture(scope="module")
def fulmen_app() -> Any:
    """The `fulmen` command tree, service commands included, as a click group (nothing is run).

    Typed loosely: recent typer releases vendor click (``typer._click``), so it is not `click.Group`."""
    cli._add_service_commands()
    group = typer.main.get_command(cli.app)
    assert "runner" in group.commands  # type: ignore[attr-defined]
    return group


def assert_parses(app: Any, args: list[str], where: str) -> None:
    """``fulmen *args`` names a subcommand whose options all exist and whose values have their types.

    ``make_context`` parses and converts the options exactly as a run would, then stops short of
    calling the command."""
    subcommand, *rest = args
    assert subcommand in app.commands, f"{where}: `fulmen {subcommand}` is no command"
    try:
        app.commands[subcommand].make_context(subcommand, list(rest))
    except Exception as e:
        if not hasattr(e, "format_message"):  # click's usage errors (unknown option, bad value) only
            raise
        raise AssertionError(f"{where}: `fulmen {shlex.join(args)}`: {e.format_message()}") from None


# --- the compose file -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose_validator() -> jsonschema.Validator:
    schema = json.loads((DEPLOY / "schema" / "compose-spec.json").read_text())
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    validator: jsonschema.Validator = validator_class(schema)
    return validator


def test_compose_file_validates_against_the_compose_spec_schema(compose_validator: jsonschema.Validator) -> None:
    """deploy/docker-compose.yml, interpolated, has no error under the Compose spec's JSON schema."""
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in compose_validator.iter_errors(compose())]
    assert errors == []


def test_the_schema_catches_a_mistake(compose_validator: jsonschema.Validator) -> None:
    """The schema check is not vacuous: a misspelt service key and a bad replica count are errors."""
    broken = compose()
    broken["services"]["runner"]["comand"] = ["runner"]
    broken["services"]["adapter"]["deploy"]["replicas"] = [2]
    messages = [e.message for e in compose_validator.iter_errors(broken)]
    assert any("comand" in m for m in messages), messages
    assert any("[2]" in m for m in messages), messages


def test_compose_needs_a_redis_password() -> None:
    """Without REDIS_PASSWORD in the environment the file refuses to load, naming the variable."""
    with pytest.raises(KeyError, match="set REDIS_PASSWORD"):
        interpolate(COMPOSE.read_text(), {})


def test_compose_replicas_are_set_per_service_from_the_environment() -> None:
    """<SERVICE>_REPLICAS scales each Fulmen service; runners default to 2, the trainer's world size follows."""
    default = fulmen_services_in_compose()
    assert default["runner"]["deploy"]["replicas"] == 2
    scaled = compose(RUNNER_REPLICAS="8", PROXY_REPLICAS="3", TRAINER_REPLICAS="2")["services"]
    assert (scaled["runner"]["deploy"]["replicas"], scaled["proxy"]["deploy"]["replicas"]) == (8, 3)
    assert scaled["trainer"]["deploy"]["replicas"] == 2
    assert scaled["trainer"]["environment"]["FULMEN_WORLD_SIZE"] == 2
    assert scaled["algorithm"]["deploy"]["replicas"] == 1  # one driver per experiment
    for name, service in default.items():
        assert isinstance(service["deploy"]["replicas"], int), name


def test_compose_wires_every_service_to_redis_with_the_password_and_to_jaeger() -> None:
    """Each Fulmen service gets REDIS_URL with the password, OTLP to Jaeger, and the settings file."""
    services = compose()["services"]
    for name, service in fulmen_services_in_compose().items():
        env = service["environment"]
        assert env["REDIS_URL"] == "redis://:s3cret@redis:6379/0", name
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318", name
        assert service["env_file"] == "fulmen.env", name
        assert service["depends_on"]["redis"]["condition"] == "service_healthy", name
    jaeger_ports = {p.split(":")[-1] for p in services["jaeger"]["ports"]}
    assert {"4317", "4318", "16686"} <= jaeger_ports
    redis = services["redis"]
    assert redis["environment"]["REDISCLI_AUTH"] == "s3cret"
    assert "--requirepass" in redis["command"][-1]
    assert any(v.startswith("./redis.conf:") for v in redis["volumes"])


def test_redis_conf_keeps_aof_on_and_no_password() -> None:
    """deploy/redis.conf turns AOF on and never holds a password (it comes from the environment)."""
    directives = {
        line.split()[0]: line.split()[1:]
        for line in (DEPLOY / "redis.conf").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    }
    assert directives["appendonly"] == ["yes"]
    assert directives["maxmemory-policy"] == ["noeviction"]
    assert "requirepass" not in directives


# --- the Kubernetes manifests ---------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(K8S.glob("*.yaml")), ids=lambda p: p.name)
def test_k8s_manifest_validates_with_kubernetes_validate(path: Path) -> None:
    """Each document validates, strictly (no unknown field), against Kubernetes' own schemas."""
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    assert docs
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            raise AssertionError(f"{path.name} {doc['kind']}/{doc['metadata']['name']}: {e.message}") from None


def test_kubernetes_validate_catches_a_mistake() -> None:
    """The k8s check is not vacuous: a misspelt probe field fails strict validation."""
    deployment = k8s_objects("Deployment")["runner"]
    container(deployment)["livenessProbe"]["httpGett"] = {"path": "/healthz"}
    with pytest.raises(kubernetes_validate.ValidationError, match="httpGett"):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_every_fulmen_deployment_has_probes_settings_and_the_redis_secret() -> None:
    """Startup and liveness on /healthz, readiness on /readyz, on the port it serves ($PORT, which
    fulmen.telemetry.http serves them on; the proxy's own port); settings from the ConfigMaps."""
    for name, deployment in k8s_objects("Deployment").items():
        if name in THIRD_PARTY:
            continue
        c = container(deployment)
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz", name
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz", name
        # before it serves (waiting for Redis, the demo's warm start) liveness must not kill it
        assert c["startupProbe"]["httpGet"]["path"] == "/healthz", name
        (port,) = c["ports"]
        assert c["livenessProbe"]["httpGet"]["port"] == port["name"], name
        assert {s["configMapRef"]["name"] for s in c["envFrom"]} == {"fulmen-settings", "fulmen-telemetry"}, name
        (redis_url,) = [e for e in c["env"] if e["name"] == "REDIS_URL"]
        assert redis_url["valueFrom"]["secretKeyRef"] == {"name": "fulmen-redis", "key": "url"}, name
    telemetry = k8s_objects("ConfigMap")["fulmen-telemetry"]["data"]
    for name, deployment in k8s_objects("Deployment").items():
        if name not in THIRD_PARTY | {"proxy"}:  # the proxy serves them on its API port
            assert container(deployment)["ports"][0]["containerPort"] == int(telemetry["PORT"]), name
    proxy = container(k8s_objects("Deployment")["proxy"])
    assert proxy["ports"][0]["containerPort"] == 8000
    assert telemetry["OTEL_EXPORTER_OTLP_ENDPOINT"].startswith("http://jaeger:")


def test_k8s_has_redis_statefulset_services_and_a_placeholder_secret() -> None:
    """Redis is a StatefulSet with a volume and the password from the Secret; proxy, redis, jaeger
    have Services; the Secret holds a placeholder, not a real password."""
    redis = k8s_objects("StatefulSet")["redis"]
    assert redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    (auth,) = container(redis)["env"]
    assert auth["valueFrom"]["secretKeyRef"] == {"name": "fulmen-redis", "key": "password"}
    services = k8s_objects("Service")
    assert {"proxy", "redis", "jaeger"} <= services.keys()
    assert {p["port"] for p in services["jaeger"]["spec"]["ports"]} >= {4317, 4318, 16686}
    secret = k8s_objects("Secret")["fulmen-redis"]["stringData"]
    assert secret["password"] == "change-me"
    assert secret["url"] == "redis://:change-me@redis:6379/0"  # the same password, for the bundled Redis


def test_k8s_redis_conf_is_deploy_redis_conf() -> None:
    """The redis.conf the StatefulSet mounts is deploy/redis.conf, word for word."""
    assert k8s_objects("ConfigMap")["redis-conf"]["data"]["redis.conf"] == (DEPLOY / "redis.conf").read_text()


def test_runners_are_scalable() -> None:
    """Runners run more than one replica by default and share no volume (nothing to scale but the count)."""
    runner = k8s_objects("Deployment")["runner"]
    assert runner["spec"]["replicas"] >= 2
    assert "volumes" not in runner["spec"]["template"]["spec"]


# --- honesty: the files against the code ----------------------------------------------------------


def test_every_procfile_service_is_in_compose_and_kubernetes_with_the_same_command(fulmen_app: Any) -> None:
    """Each Procfile process has a compose service and a Deployment (Redis: a StatefulSet) of its
    name, running the same `fulmen` command line; Redis runs redis-server there instead."""
    services = compose()["services"]
    workloads = {**k8s_objects("Deployment"), **k8s_objects("StatefulSet")}
    for name, command in procfile().items():
        assert name in services, f"Procfile's {name} has no compose service"
        assert name in workloads, f"Procfile's {name} has no Deployment"
        if name == "redis":
            assert workloads[name]["kind"] == "StatefulSet"
            continue
        assert command[0] == "fulmen", name
        assert services[name]["command"] == command[1:], name
        assert container(workloads[name])["args"] == command[1:], name
        assert workloads[name]["kind"] == "Deployment"
    # and nothing deployed that the Procfile does not run, besides Jaeger
    assert set(services) - set(procfile()) == {"jaeger"}
    assert {n for n, w in workloads.items() if w["kind"] == "Deployment"} - set(procfile()) == {"jaeger"}


def test_every_deployed_command_is_a_fulmen_subcommand_whose_flags_parse(fulmen_app: Any) -> None:
    """The Dockerfile's entry point is `fulmen`; each compose command and Deployment args parse as
    one of its subcommands with its options (an unknown flag or a bad value fails here)."""
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["fulmen"]' in dockerfile
    for name, service in fulmen_services_in_compose().items():
        assert_parses(fulmen_app, service["command"], f"compose {name}")
    for name, deployment in k8s_objects("Deployment").items():
        if name not in THIRD_PARTY:
            assert_parses(fulmen_app, container(deployment)["args"], f"k8s {name}")
    for name, command in procfile().items():
        assert_parses(fulmen_app, command[1:], f"Procfile {name}")


def test_the_flag_check_catches_a_mistake(fulmen_app: Any) -> None:
    """An unknown flag or a wrong-typed value is caught, so the check above can fail."""
    with pytest.raises(AssertionError, match="--concurency"):
        assert_parses(fulmen_app, ["runner", "--concurency", "64"], "test")
    with pytest.raises(AssertionError, match="is no command"):
        assert_parses(fulmen_app, ["proxy"], "test")


def test_every_fulmen_variable_named_in_deploy_is_a_settings_field() -> None:
    """FULMEN_* in the env file, the ConfigMap, compose, the manifests and the README's deploy section
    are all fields of some service's settings (Fulmen refuses an unknown one at start)."""
    known = settings_env_names()
    env_file = {
        line.split("=", 1)[0]
        for line in (DEPLOY / "fulmen.env").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    configmap = set(k8s_objects("ConfigMap")["fulmen-settings"]["data"])
    assert env_file and configmap
    assert all(name.startswith("FULMEN_") for name in env_file | configmap)
    assert env_file - known == set()
    assert configmap - known == set()
    texts = [p.read_text() for p in [COMPOSE, DEPLOY / "Dockerfile", *K8S.glob("*.yaml")]]
    readme = (REPO / "README.md").read_text()
    texts.append(readme[readme.index("## Deploying") :])
    named = {m for text in texts for m in FULMEN_NAME.findall(text)}
    assert named - known == set()


def test_containers_serve_the_ops_endpoints_on_every_interface() -> None:
    """The default address of /healthz /readyz /metrics is loopback; every container setting opens it."""
    env_file = dict(
        line.split("=", 1) for line in (DEPLOY / "fulmen.env").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    )  # fmt: skip
    assert env_file["FULMEN_METRICS_HOST"] == "0.0.0.0"
    assert k8s_objects("ConfigMap")["fulmen-settings"]["data"]["FULMEN_METRICS_HOST"] == "0.0.0.0"
    assert re.search(r"^ENV .*\bFULMEN_METRICS_HOST=0\.0\.0\.0\b", (DEPLOY / "Dockerfile").read_text(), re.M)


def test_dockerfile_installs_cpu_torch_first_within_the_package_range() -> None:
    """torch==2.13.0 is installed before the package, and the package's torch range admits it."""
    text = (DEPLOY / "Dockerfile").read_text()
    runs = [line for line in text.splitlines() if line.startswith("RUN pip install")]
    assert "torch==" in runs[0] and "/cpu" in text
    assert any('".[train]"' in r for r in runs[1:])
    version = re.search(r"ARG TORCH_VERSION=(\S+)", text)
    assert version is not None and version.group(1) == "2.13.0"
    pyproject = (REPO / "pyproject.toml").read_text()
    (torch_req,) = [Requirement(r) for r in re.findall(r'"(torch[^"]*)"', pyproject) if r.startswith("torch")]
    assert torch_req.specifier.contains(version.group(1))


# --- the GPU variants -----------------------------------------------------------------------------


def _after_fulmen(command: list[str]) -> list[str]:
    """A torchrun line's `fulmen` arguments (what follows the executable torchrun starts)."""
    return command[command.index("fulmen") + 1 :]


def test_gpu_procfile_runs_the_trainer_under_torchrun_and_parses(fulmen_app: Any) -> None:
    processes = {}
    for line in (DEPLOY / "Procfile.gpu").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, command = line.split(":", 1)
            processes[name.strip()] = shlex.split(interpolate(command, {}))
    assert set(processes) == set(procfile())
    trainer = processes["trainer"]
    assert trainer[:2] == ["torchrun", "--no-python"] and "--nproc-per-node" in trainer
    assert_parses(fulmen_app, _after_fulmen(trainer), "Procfile.gpu trainer")
    assert trainer[trainer.index("--parallel") : trainer.index("--parallel") + 2] == ["--parallel", "ddp"]
    for name, command in processes.items():
        if name != "trainer":
            assert command[0] == "fulmen", name
            assert_parses(fulmen_app, command[1:], f"Procfile.gpu {name}")
    assert "--device" in processes["proxy"]


def test_gpu_compose_override_validates_and_asks_for_gpus(compose_validator: jsonschema.Validator,
                                                          fulmen_app: Any) -> None:
    override = yaml.safe_load(interpolate((DEPLOY / "docker-compose.gpu.yml").read_text(), {"TRAINER_GPUS": "2"}))
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in compose_validator.iter_errors(override)]
    assert errors == []
    assert set(override["services"]) <= set(compose()["services"])
    trainer, proxy = override["services"]["trainer"], override["services"]["proxy"]
    assert trainer["entrypoint"][-1] == "fulmen" and trainer["entrypoint"][0] == "torchrun"
    assert_parses(fulmen_app, trainer["command"], "compose gpu trainer")
    assert_parses(fulmen_app, proxy["command"], "compose gpu proxy")
    for service, count in ((trainer, 2), (proxy, 1)):
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and int(device["count"]) == count


@pytest.mark.parametrize("path", sorted(p for p in (DEPLOY / "k8s-gpu").glob("*.yaml") if p.name != "vllm.yaml"),
                         ids=lambda p: p.name)
def test_gpu_k8s_manifests_validate_parse_and_request_gpus(path: Path, fulmen_app: Any) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    for d in docs:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
    (doc,) = [d for d in docs if d["kind"] == "Deployment"]
    cpu = k8s_objects("Deployment")[doc["metadata"]["name"]]  # it replaces the CPU Deployment of its name
    assert doc["spec"]["selector"] == cpu["spec"]["selector"]
    spec = container(doc)
    assert_parses(fulmen_app, spec["args"], f"k8s-gpu {path.name}")
    assert int(spec["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    if "command" in spec:  # the trainer: torchrun starts one `fulmen` per GPU
        assert spec["command"][0] == "torchrun" and spec["command"][-1] == "fulmen"
        gpus = spec["command"][spec["command"].index("--nproc-per-node") + 1]
        assert int(gpus) == int(spec["resources"]["limits"]["nvidia.com/gpu"])
    named = set(FULMEN_NAME.findall(path.read_text()))
    assert named - settings_env_names() == set()


def test_vllm_procfile_runs_vllm_sync_beside_the_server_and_parses(fulmen_app: Any) -> None:
    processes = {}
    for line in (DEPLOY / "Procfile.vllm").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, command = line.split(":", 1)
            processes[name.strip()] = shlex.split(command)
    assert set(processes) == set(procfile()) | {"vllm", "vllm-sync"}
    server = processes["vllm"]
    assert "VLLM_SERVER_DEV_MODE=1" in server and "vllm.entrypoints.openai.api_server" in server
    port = server[server.index("--port") + 1]
    for name, command in processes.items():
        if name != "vllm":
            assert command[0] == "fulmen", name
            assert_parses(fulmen_app, command[1:], f"Procfile.vllm {name}")
    assert processes["vllm-sync"][-1] == f"http://127.0.0.1:{port}"
    assert processes["proxy"][processes["proxy"].index("--upstream-urls") + 1] == f"http://127.0.0.1:{port}"
    named = set(FULMEN_NAME.findall((DEPLOY / "Procfile.vllm").read_text()))
    assert named - settings_env_names() == set()


def test_vllm_compose_override_runs_vllm_sync_beside_the_server(compose_validator: jsonschema.Validator,
                                                                fulmen_app: Any) -> None:
    override = yaml.safe_load(interpolate((DEPLOY / "docker-compose.vllm.yml").read_text(), {"REDIS_PASSWORD": "s3cret"}))
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in compose_validator.iter_errors(override)]
    assert errors == []
    services = override["services"]
    assert set(services) - set(compose()["services"]) == {"vllm", "vllm-sync"}
    server, sync, proxy = services["vllm"], services["vllm-sync"], services["proxy"]
    assert server["environment"]["VLLM_SERVER_DEV_MODE"] == "1"
    assert_parses(fulmen_app, sync["command"], "compose vllm-sync")
    assert_parses(fulmen_app, proxy["command"], "compose vllm proxy")
    port = server["command"][server["command"].index("--port") + 1]
    url = f"http://vllm:{port}"
    assert sync["command"][sync["command"].index("--vllm-url") + 1] == url
    assert proxy["command"][proxy["command"].index("--upstream-urls") + 1] == url
    served = server["command"][server["command"].index("--served-model-name") + 1]
    assert sync["command"][sync["command"].index("--model-name") + 1] == served
    assert proxy["command"][proxy["command"].index("--model-name") + 1] == served
    sync_dir = sync["command"][sync["command"].index("--sync-dir") + 1]
    assert f"vllm-sync:{sync_dir}" in server["volumes"] and f"vllm-sync:{sync_dir}" in sync["volumes"]
    assert sync["environment"]["REDIS_URL"] == compose()["services"]["runner"]["environment"]["REDIS_URL"]


def test_vllm_statefulset_runs_vllm_sync_beside_each_server(fulmen_app: Any) -> None:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s-gpu" / "vllm.yaml").read_text()) if d]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    (server_set,) = [d for d in docs if d["kind"] == "StatefulSet"]
    containers = {c["name"]: c for c in server_set["spec"]["template"]["spec"]["containers"]}
    sync, server = containers["vllm-sync"], containers["vllm"]
    assert_parses(fulmen_app, sync["args"], "k8s-gpu vllm-sync")
    port = server["args"][server["args"].index("--port") + 1]
    assert sync["args"][sync["args"].index("--vllm-url") + 1] == f"http://127.0.0.1:{port}"
    assert {"name": "VLLM_SERVER_DEV_MODE", "value": "1"} in server["env"]
    sync_dir = sync["args"][sync["args"].index("--sync-dir") + 1]
    mounts = {m["name"]: m["mountPath"] for m in server["volumeMounts"]}
    assert mounts["sync"] == sync_dir == {m["name"]: m["mountPath"] for m in sync["volumeMounts"]}["sync"]
    named = set(FULMEN_NAME.findall((DEPLOY / "k8s-gpu" / "vllm.yaml").read_text()))
    assert named - settings_env_names() == set()
