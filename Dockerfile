# The API image: no torch, no GPU.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY src ./src
COPY migrations ./migrations
RUN pip install --no-cache-dir -e .
EXPOSE 8000
CMD ["batchwright", "serve", "--host", "0.0.0.0", "--port", "8000"]
