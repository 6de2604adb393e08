//! Strict decoding, as the API server's `fieldValidation=Strict` (kubectl's default): a field
//! given twice, or one the type does not have, is an error.

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

/// A JSON value read from YAML or JSON, refusing a mapping that repeats a key.
#[derive(Debug)]
pub struct NoDupValue(pub Value);

impl<'de> Deserialize<'de> for NoDupValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ValueVisitor).map(NoDupValue)
    }
}

struct ValueVisitor;

impl<'de> Visitor<'de> for ValueVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON-compatible value")
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        NoDupValue::deserialize(d).map(|v| v.0)
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        Number::from_f64(v)
            .map(Value::Number)
            .ok_or_else(|| E::custom(format!("{v} is not a JSON number")))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(v) = seq.next_element::<NoDupValue>()? {
            items.push(v.0);
        }
        Ok(Value::Array(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let value = map.next_value::<NoDupValue>()?;
            if out.contains_key(&key) {
                return Err(de::Error::custom(format!("duplicate field {key:?}")));
            }
            out.insert(key, value.0);
        }
        Ok(Value::Object(out))
    }
}

/// Collects the paths (`.spec.devices[0].nmae`) of fields in `input` that the typed value,
/// serialized back (`round`), lacks: fields the type does not know. Nulls count as absent.
pub fn unknown_fields(input: &Value, round: &Value, path: &str, out: &mut Vec<String>) {
    match (input, round) {
        (Value::Object(i), Value::Object(r)) => {
            for (k, v) in i {
                if v.is_null() {
                    continue;
                }
                let p = format!("{path}.{k}");
                match r.get(k) {
                    None => out.push(p),
                    Some(rv) => unknown_fields(v, rv, &p, out),
                }
            }
        }
        (Value::Array(i), Value::Array(r)) => {
            for (n, (v, rv)) in i.iter().zip(r).enumerate() {
                unknown_fields(v, rv, &format!("{path}[{n}]"), out);
            }
        }
        _ => {}
    }
}
