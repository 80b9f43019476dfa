FROM python:3.11-slim
WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir .
ENV KEEL_ENVIRONMENT=production
CMD ["keel", "--help"]
