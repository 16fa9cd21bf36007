#!/bin/bash
# Runs once, from /docker-entrypoint-initdb.d, when the postgres container initialises an empty data
# volume: one login role and one database each for Prefect and MLflow, each database owned by its
# role and closed to everyone else. Passwords come from the container's environment (infra/.env);
# psql quotes them as literals. Changing one later takes `ALTER ROLE ... PASSWORD`, not a restart.
set -euo pipefail
: "${PREFECT_DB_PASSWORD:?PREFECT_DB_PASSWORD is not set}"
: "${MLFLOW_DB_PASSWORD:?MLFLOW_DB_PASSWORD is not set}"

create_database() {
  psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname postgres \
    -v name="$1" -v password="$2" <<'SQL'
CREATE ROLE :"name" LOGIN PASSWORD :'password';
CREATE DATABASE :"name" OWNER :"name";
REVOKE ALL ON DATABASE :"name" FROM PUBLIC;
SQL
}

create_database prefect "$PREFECT_DB_PASSWORD"
create_database mlflow "$MLFLOW_DB_PASSWORD"
# Prefect's migrations use pg_trgm; created here by the superuser
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname prefect -c 'CREATE EXTENSION IF NOT EXISTS pg_trgm;'
echo "init-databases: created databases prefect and mlflow"
