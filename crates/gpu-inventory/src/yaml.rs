//! YAML written for other tools to read (`--dry-run -o yaml`, `--dump-topology`, `dractl -o
//! yaml`): block style, and every string that a YAML 1.1 reader (PyYAML, Ruby's Psych, many CI
//! tools) would resolve to something else quoted: `0000:05:00.0` is a base-60 float there,
//! `on`, `y` and `no` are bools, `1_000` and `0b11` ints, `2024-01-01` a date, `~` null.
//! YAML 1.2 readers (serde_yaml_ng, Go's yaml.v3, kubectl) read the same values either way.

/// `value` as one YAML document (no leading `---`), YAML 1.1-safe as the module says.
///
/// # Errors
/// What the serializer reports: a value YAML cannot hold (a map with non-string keys).
pub fn to_string<T: serde::Serialize>(value: &T) -> Result<String, String> {
    let options = serde_saphyr::ser_options! {
        // Long strings stay on one line, exactly as given; multi-line ones are escaped.
        prefer_block_scalars: false,
    };
    serde_saphyr::to_string_with_options(value, options).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_a_yaml_1_1_reader_would_retype_are_quoted_and_the_rest_are_plain() {
        for retyped in [
            "0000:05:00.0",
            "1:20",
            "yes",
            "No",
            "on",
            "OFF",
            "y",
            "n",
            "1_000",
            "0b1010",
            "017",
            "0x1F",
            "2024-01-01",
            "~",
            "null",
            ".inf",
            "-.Inf",
            ".NaN",
            "1e3",
            "12",
            "",
        ] {
            let text = to_string(&serde_json::json!({ "k": retyped })).unwrap();
            let value = text.trim_end().strip_prefix("k: ").expect(&text);
            assert!(
                value.starts_with(['\'', '"']),
                "{retyped:?} written unquoted: {text}"
            );
            let back: serde_json::Value = serde_yaml_ng::from_str(&text).unwrap();
            assert_eq!(back["k"], retyped, "{text}");
        }
        let text = to_string(&serde_json::json!({
            "product": "NVIDIA H100 80GB HBM3",
            "uuid": "GPU-5e0c4a1b-7d2f-4c83-9b6e-2f1a8d3c7e40",
            "count": 8,
            "on": true,
        }))
        .unwrap();
        // Keys too: `on` is a bool to a YAML 1.1 reader.
        assert!(
            text.contains("'on': true\n") || text.contains("\"on\": true\n"),
            "{text}"
        );
        assert!(text.contains("product: NVIDIA H100 80GB HBM3\n"), "{text}");
        assert!(
            text.contains("uuid: GPU-5e0c4a1b-7d2f-4c83-9b6e-2f1a8d3c7e40\n"),
            "{text}"
        );
        assert!(text.contains("count: 8\n"), "{text}");
    }
}
