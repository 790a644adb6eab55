//! The untyped settings tree: model.toml's tables and values, each with its origin,
//! and `--set key=value` overrides applied on top.

use std::collections::BTreeMap;

use toml::de::{DeTable, DeValue};
use toml::Spanned;

use crate::error::{origin_at, Origin, SpecError};

/// A value and where it was written.
#[derive(Clone, Debug)]
pub struct Entry {
    /// The value.
    pub value: Raw,
    /// Where the value was written.
    pub origin: Origin,
    /// Where its key was written (for "unknown key" errors).
    pub key_origin: Origin,
}

/// An untyped value.
#[derive(Clone, Debug)]
pub enum Raw {
    /// An integer.
    Int(i64),
    /// A float.
    Float(f64),
    /// A boolean.
    Bool(bool),
    /// A string.
    Str(String),
    /// An array.
    Array(Vec<Entry>),
    /// A table.
    Table(Table),
    /// A date or time (never valid in model.toml).
    Datetime,
}

/// A table: keys in sorted order, so processing is deterministic.
pub type Table = BTreeMap<String, Entry>;

impl Raw {
    /// Human name of the value's type, for "expected X, found Y" messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Raw::Int(_) => "an integer",
            Raw::Float(_) => "a float",
            Raw::Bool(_) => "a boolean",
            Raw::Str(_) => "a string",
            Raw::Array(_) => "an array",
            Raw::Table(_) => "a table",
            Raw::Datetime => "a date-time",
        }
    }
}

/// Parse model.toml text into a settings tree.
pub fn parse_document(file: &str, text: &str) -> Result<Table, SpecError> {
    let doc = DeTable::parse(text).map_err(|e| syntax_error(file, text, &e, 0))?;
    convert_table(file, text, doc.get_ref(), 0)
}

fn syntax_error(file: &str, text: &str, e: &toml::de::Error, offset: usize) -> SpecError {
    let origin = match e.span() {
        Some(span) => origin_at(text, span.start + offset),
        None => Origin::Default,
    };
    let message = e.message().trim().trim_end_matches('.').to_string();
    let err = SpecError::new(
        file,
        origin.clone(),
        format!("TOML syntax error: {message}"),
    );
    // toml says "duplicate key" for a repeated key and for a repeated [table] alike.
    let (Some(span), "duplicate key") = (e.span(), message.as_str()) else {
        return err;
    };
    let name = text
        .get(span.start + offset..span.end + offset)
        .unwrap_or("")
        .trim();
    let header = matches!(&origin, Origin::File { text, .. } if text.trim_start().starts_with('['));
    if header {
        SpecError::new(
            file,
            origin,
            format!("TOML syntax error: table [{name}] is defined twice"),
        )
        .with_help(format!("put all of [{name}]'s keys under its first header"))
    } else {
        SpecError::new(
            file,
            origin,
            format!("TOML syntax error: duplicate key `{name}`"),
        )
        .with_help("a key may appear only once in a table; remove one of the two")
    }
}

fn convert_table(
    file: &str,
    text: &str,
    table: &DeTable<'_>,
    offset: usize,
) -> Result<Table, SpecError> {
    let mut out = Table::new();
    for (key, value) in table.iter() {
        let key_origin = origin_at(text, key.span().start + offset);
        let v = convert_value(file, text, value, offset)?;
        out.insert(
            key.get_ref().to_string(),
            Entry {
                value: v,
                origin: origin_at(text, value.span().start + offset),
                key_origin,
            },
        );
    }
    Ok(out)
}

fn convert_value(
    file: &str,
    text: &str,
    value: &Spanned<DeValue<'_>>,
    offset: usize,
) -> Result<Raw, SpecError> {
    let at = || origin_at(text, value.span().start + offset);
    Ok(match value.get_ref() {
        DeValue::String(s) => Raw::Str(s.to_string()),
        DeValue::Integer(i) => {
            let n = i64::from_str_radix(i.as_str(), i.radix()).map_err(|_| {
                SpecError::new(
                    file,
                    at(),
                    format!("integer {} does not fit in 64 bits", i.as_str()),
                )
                .with_help(format!("integers must be at most {}", i64::MAX))
            })?;
            Raw::Int(n)
        }
        DeValue::Float(f) => {
            let x: f64 = f
                .as_str()
                .parse()
                .map_err(|_| SpecError::new(file, at(), format!("bad float `{f}`")))?;
            Raw::Float(x)
        }
        DeValue::Boolean(b) => Raw::Bool(*b),
        DeValue::Datetime(_) => Raw::Datetime,
        DeValue::Array(items) => {
            let mut out = Vec::new();
            for item in items {
                out.push(Entry {
                    value: convert_value(file, text, item, offset)?,
                    origin: origin_at(text, item.span().start + offset),
                    key_origin: origin_at(text, item.span().start + offset),
                });
            }
            Raw::Array(out)
        }
        DeValue::Table(t) => Raw::Table(convert_table(file, text, t, offset)?),
    })
}

/// Apply one `--set key.path=value` override. The value is read as a TOML value
/// (`2`, `true`, `"1f1b"`, `[0.9, 0.95]`); a word that is not one is taken as a string,
/// so `--set parallel.schedule=1f1b` works without quotes.
pub fn apply_set(root: &mut Table, file: &str, arg: &str) -> Result<(), SpecError> {
    let origin = Origin::Set(arg.to_string());
    let err = |m: String| SpecError::new(file, origin.clone(), m);
    let Some((path, text)) = arg.split_once('=') else {
        return Err(err("expected KEY=VALUE, e.g. --set parallel.tp=2".into()));
    };
    let path = path.trim();
    let text = text.trim();
    let keys: Vec<&str> = path.split('.').map(str::trim).collect();
    if keys.iter().any(|k| k.is_empty()) {
        return Err(err(format!("`{path}` is not a key path like parallel.tp")));
    }
    if text.is_empty() {
        return Err(err(format!(
            "`{path}=` has no value; write one after `=`, e.g. --set parallel.tp=2"
        )));
    }
    let value = match DeValue::parse(text) {
        Ok(v) => set_entries(file, text, &v, &origin)?,
        Err(_) if !text.is_empty() && !text.contains(['"', '\'', '[', ']', '{', '}']) => {
            Raw::Str(text.to_string())
        }
        Err(e) => {
            return Err(err(format!(
                "cannot read value `{text}`: {}",
                e.message().trim()
            )))
        }
    };
    let mut table = root;
    for (i, key) in keys.iter().enumerate() {
        if i + 1 == keys.len() {
            table.insert(
                key.to_string(),
                Entry {
                    value,
                    origin: origin.clone(),
                    key_origin: origin.clone(),
                },
            );
            return Ok(());
        }
        let entry = table.entry(key.to_string()).or_insert_with(|| Entry {
            value: Raw::Table(Table::new()),
            origin: origin.clone(),
            key_origin: origin.clone(),
        });
        match &mut entry.value {
            Raw::Table(t) => table = t,
            other => {
                return Err(err(format!(
                    "`{}` is {}, not a table",
                    keys[..=i].join("."),
                    other.type_name()
                )))
            }
        }
    }
    Ok(())
}

fn set_entries(
    file: &str,
    text: &str,
    v: &Spanned<DeValue<'_>>,
    origin: &Origin,
) -> Result<Raw, SpecError> {
    // Reuse the document conversion; every origin then points at the --set argument.
    let mut raw = convert_value(file, text, v, 0).map_err(|mut e| {
        e.origin = origin.clone();
        e
    })?;
    reset_origins(&mut raw, origin);
    Ok(raw)
}

fn reset_origins(raw: &mut Raw, origin: &Origin) {
    let entries: Box<dyn Iterator<Item = &mut Entry>> = match raw {
        Raw::Array(items) => Box::new(items.iter_mut()),
        Raw::Table(t) => Box::new(t.values_mut()),
        _ => return,
    };
    for e in entries {
        e.origin = origin.clone();
        e.key_origin = origin.clone();
        reset_origins(&mut e.value, origin);
    }
}
