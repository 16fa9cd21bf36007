"""The Prefect flow over the DVC stages, against a temporary Prefect server."""
import json

import pandas as pd
import pytest
from prefect.client.orchestration import get_client
from prefect.testing.utilities import prefect_test_harness

from flows.pipeline import EPHEMERAL_STARTUP_S, longlive_pipeline, patient_temporary_server, stage_order

pytestmark = pytest.mark.slow


def test_stage_order_follows_the_dvc_graph(repo_copy):
    assert stage_order(repo_copy) == ["weights", "demo_data", "ingest", "shots", "iqa_filter", "caption",
                                      "assemble", "encode_latents", "train_ar", "distill_dmd",
                                      "merge_w4a4", "evaluate", "package"]
    assert stage_order(repo_copy, ["ingest"]) == ["demo_data", "ingest"]
    assert stage_order(repo_copy, ["demo_data"]) == ["demo_data"]
    with pytest.raises(ValueError, match=r"unknown stage\(s\) \['nope'\]"):
        stage_order(repo_copy, ["nope"])


def test_flow_runs_one_task_per_stage_and_records_the_pipeline(repo_copy):
    with prefect_test_harness(server_startup_timeout=120):
        state = longlive_pipeline(repo_root=str(repo_copy), targets=["ingest"], return_state=True)
        assert state.is_completed(), state
        assert state.result() == ["demo_data", "ingest"]
        flow_run_id = state.state_details.flow_run_id

        import asyncio

        async def task_runs():
            from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

            async with get_client() as client:
                runs = await client.read_task_runs(
                    flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
                return sorted((r.name, r.state.type.value) for r in runs)

        runs = asyncio.run(task_runs())
    assert runs == [("demo_data", "COMPLETED"), ("ingest", "COMPLETED"), ("record-pipeline", "COMPLETED")]
    m = pd.read_parquet(repo_copy / "data/ingest/manifest.parquet")
    assert (m["status"] == "ok").sum() == 5
    assert json.loads((repo_copy / "reports/ingest/run.json").read_text())["mlflow_run_id"]
    assert (repo_copy / "dvc.lock").is_file()


def test_a_command_line_run_waits_for_prefects_temporary_server_and_keeps_a_longer_wait():
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS as wait
    from prefect.settings import temporary_settings

    with temporary_settings(restore_defaults={wait}), patient_temporary_server():
        assert wait.value() == EPHEMERAL_STARTUP_S > 20  # Prefect's own default is 20 s
    with temporary_settings(updates={wait: 600}), patient_temporary_server():
        assert wait.value() == 600
