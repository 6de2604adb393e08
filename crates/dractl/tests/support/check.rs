//! Comparing our allocation report with the oracle's, and property checks on our results.

use std::collections::{BTreeMap, HashMap, HashSet};

use dra_cel::libs::quantity::Quantity;
use dra_cel::{Compiler, Environment, Features};
use serde_json::{Value, json};

/// A node's outcome kind: `allocated`, `unallocated` or `error`.
pub fn kind(node: &Value) -> &'static str {
    if node.get("error").is_some() {
        "error"
    } else if node["allocated"] == json!(true) {
        "allocated"
    } else if node["allocated"] == json!(false) {
        "unallocated"
    } else {
        "malformed"
    }
}

fn canonical_quantity(v: &Value) -> Value {
    match v.as_str().map(Quantity::parse) {
        Some(Ok(q)) => json!(q.to_string()),
        _ => v.clone(),
    }
}

/// What is compared of one allocation: every field, with `shareID` reduced to its presence,
/// quantities in canonical form, and unset booleans and empty lists dropped.
pub fn normalize_allocation(a: &Value) -> Value {
    let mut a = a.clone();
    if let Some(results) = a
        .pointer_mut("/devices/results")
        .and_then(Value::as_array_mut)
    {
        for r in results {
            let Some(o) = r.as_object_mut() else { continue };
            if let Some(id) = o.get_mut("shareID") {
                *id = json!("<present>");
            }
            if let Some(Value::Object(cc)) = o.get_mut("consumedCapacity") {
                for v in cc.values_mut() {
                    *v = canonical_quantity(v);
                }
            }
            if o.get("adminAccess") == Some(&json!(false)) {
                o.remove("adminAccess");
            }
        }
    }
    strip_empty(&mut a);
    a
}

fn strip_empty(v: &mut Value) {
    match v {
        Value::Object(o) => {
            o.retain(|_, x| {
                !(x.is_null()
                    || x.as_array().is_some_and(Vec::is_empty)
                    || x.as_object().is_some_and(|m| m.is_empty()))
            });
            for x in o.values_mut() {
                strip_empty(x);
            }
        }
        Value::Array(a) => a.iter_mut().for_each(strip_empty),
        _ => {}
    }
}

/// Differences between the oracle's report (`want`) and ours (`got`), one line each.
pub fn compare(want: &Value, got: &Value) -> Vec<String> {
    let mut diffs = Vec::new();
    let empty = Vec::new();
    let w = want["nodes"].as_array().unwrap_or(&empty);
    let g = got["nodes"].as_array().unwrap_or(&empty);
    if w.len() != g.len() {
        diffs.push(format!(
            "{} nodes from the oracle, {} from us",
            w.len(),
            g.len()
        ));
        return diffs;
    }
    for (wn, gn) in w.iter().zip(g) {
        let name = wn["name"].as_str().unwrap_or("?");
        if wn["name"] != gn["name"] {
            diffs.push(format!("node order: oracle {name}, us {}", gn["name"]));
            continue;
        }
        let (wk, gk) = (kind(wn), kind(gn));
        if wk != gk {
            let detail = |n: &Value| {
                n.get("error")
                    .or_else(|| n.get("reason"))
                    .map(|v| v.to_string())
                    .unwrap_or_else(|| brief(n))
            };
            diffs.push(format!(
                "node {name}: oracle {wk} ({}), us {gk} ({})",
                detail(wn),
                detail(gn)
            ));
            continue;
        }
        if wk != "allocated" {
            continue;
        }
        let wc = wn["claims"].as_array().unwrap_or(&empty);
        let gc = gn["claims"].as_array().unwrap_or(&empty);
        if wc.len() != gc.len() {
            diffs.push(format!(
                "node {name}: {} claims from the oracle, {} from us",
                wc.len(),
                gc.len()
            ));
            continue;
        }
        for (a, b) in wc.iter().zip(gc) {
            let claim = format!(
                "{}/{}",
                a["namespace"].as_str().unwrap_or(""),
                a["name"].as_str().unwrap_or("")
            );
            if a["namespace"] != b["namespace"] || a["name"] != b["name"] {
                diffs.push(format!(
                    "node {name}: claim order: oracle {claim}, us {}/{}",
                    b["namespace"], b["name"]
                ));
                continue;
            }
            let (na, nb) = (
                normalize_allocation(&a["allocation"]),
                normalize_allocation(&b["allocation"]),
            );
            if na != nb {
                diffs.push(format!(
                    "node {name} claim {claim}:\n    oracle {}\n    us     {}",
                    na, nb
                ));
            }
        }
    }
    diffs
}

/// `request=driver/pool/device` per result, for messages.
pub fn brief(node: &Value) -> String {
    let mut parts = Vec::new();
    for c in node["claims"].as_array().into_iter().flatten() {
        for r in c
            .pointer("/allocation/devices/results")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            parts.push(format!(
                "{}={}/{}/{}",
                r["request"].as_str().unwrap_or(""),
                r["driver"].as_str().unwrap_or(""),
                r["pool"].as_str().unwrap_or(""),
                r["device"].as_str().unwrap_or("")
            ));
        }
    }
    parts.join(",")
}

// ---------------------------------------------------------------------------------------------
// Property checks.

type DevKey = (String, String, String);

struct SliceDev {
    slice: Value,
    device: Value,
}

fn q(v: &Value) -> Option<Quantity> {
    match v {
        Value::String(s) => Quantity::parse(s).ok(),
        Value::Number(n) => Quantity::parse(&n.to_string()).ok(),
        _ => None,
    }
}

/// The device's attribute or capacity entry under `domain/name`, also found unqualified when
/// the domain is the driver's.
fn lookup<'a>(map: &'a Value, driver: &str, qualified: &str) -> Option<&'a Value> {
    let map = map.as_object()?;
    if let Some(v) = map.get(qualified) {
        return Some(v);
    }
    let (domain, name) = qualified.split_once('/')?;
    if domain == driver {
        map.get(name)
    } else {
        None
    }
}

/// Checks what must hold for every node we allocated: devices exist and are current, no device
/// is double-booked, shared capacity and counters are not exceeded, every class and request
/// selector matches, and match/distinct constraints hold. Returns the violations.
pub fn properties(objects: &[Value], report: &Value) -> Vec<String> {
    let mut out = Vec::new();
    // Current devices: the slices of each pool's highest generation.
    let mut max_gen: HashMap<(String, String), i64> = HashMap::new();
    for o in objects.iter().filter(|o| o["kind"] == "ResourceSlice") {
        let key = (
            o["spec"]["driver"].as_str().unwrap_or("").to_owned(),
            o["spec"]["pool"]["name"].as_str().unwrap_or("").to_owned(),
        );
        let g = o["spec"]["pool"]["generation"].as_i64().unwrap_or(0);
        let e = max_gen.entry(key).or_insert(g);
        *e = (*e).max(g);
    }
    let mut devices: HashMap<DevKey, SliceDev> = HashMap::new();
    let mut counters: HashMap<(String, String, String, String), Quantity> = HashMap::new();
    for o in objects.iter().filter(|o| o["kind"] == "ResourceSlice") {
        let driver = o["spec"]["driver"].as_str().unwrap_or("").to_owned();
        let pool = o["spec"]["pool"]["name"].as_str().unwrap_or("").to_owned();
        if Some(&o["spec"]["pool"]["generation"].as_i64().unwrap_or(0))
            != max_gen.get(&(driver.clone(), pool.clone()))
        {
            continue;
        }
        for d in o["spec"]["devices"].as_array().into_iter().flatten() {
            let name = d["name"].as_str().unwrap_or("").to_owned();
            devices.insert(
                (driver.clone(), pool.clone(), name),
                SliceDev {
                    slice: o.clone(),
                    device: d.clone(),
                },
            );
        }
        for set in o["spec"]["sharedCounters"].as_array().into_iter().flatten() {
            for (c, v) in set["counters"].as_object().into_iter().flatten() {
                if let Some(qv) = q(&v["value"]) {
                    counters.insert(
                        (
                            driver.clone(),
                            pool.clone(),
                            set["name"].as_str().unwrap_or("").to_owned(),
                            c.clone(),
                        ),
                        qv,
                    );
                }
            }
        }
    }
    let classes: HashMap<String, Value> = objects
        .iter()
        .filter(|o| o["kind"] == "DeviceClass")
        .map(|o| {
            (
                o["metadata"]["name"].as_str().unwrap_or("").to_owned(),
                o.clone(),
            )
        })
        .collect();
    // Pod claims (to allocate) by namespace/name, and in-use results.
    let mut pod_claims: HashMap<String, Value> = HashMap::new();
    let mut in_use: Vec<Value> = Vec::new();
    for o in objects.iter().filter(|o| o["kind"] == "ResourceClaim") {
        let ns = o["metadata"]["namespace"]
            .as_str()
            .filter(|s| !s.is_empty())
            .unwrap_or("default");
        let key = format!("{ns}/{}", o["metadata"]["name"].as_str().unwrap_or(""));
        match o
            .pointer("/status/allocation/devices/results")
            .and_then(Value::as_array)
        {
            Some(results) if o.pointer("/status/allocation").is_some() => {
                in_use.extend(results.iter().cloned())
            }
            _ => {
                if o.pointer("/status/allocation").is_none() {
                    pod_claims.insert(key, o.clone());
                }
            }
        }
    }
    let compiler = Compiler::new(Features::default(), Environment::Stored);
    for node in report["nodes"].as_array().into_iter().flatten() {
        if kind(node) != "allocated" {
            continue;
        }
        let node_name = node["name"].as_str().unwrap_or("");
        let mut results: Vec<(Value, Option<Value>)> =
            in_use.iter().map(|r| (r.clone(), None)).collect();
        for c in node["claims"].as_array().into_iter().flatten() {
            let key = format!(
                "{}/{}",
                c["namespace"].as_str().unwrap_or(""),
                c["name"].as_str().unwrap_or("")
            );
            let claim = pod_claims.get(&key).cloned();
            if claim.is_none() {
                out.push(format!("node {node_name}: result for unknown claim {key}"));
            }
            let rs = c
                .pointer("/allocation/devices/results")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            if rs.len() > 32 {
                out.push(format!(
                    "node {node_name}: claim {key} has {} results (limit 32)",
                    rs.len()
                ));
            }
            for r in &rs {
                results.push((r.clone(), claim.clone()));
            }
            if let Some(claim) = &claim {
                constraints(claim, &rs, &devices, node_name, &mut out);
            }
        }
        // Exclusive use, shared capacity, counters.
        let mut exclusive: HashSet<DevKey> = HashSet::new();
        let mut shared_ids: HashSet<String> = HashSet::new();
        let mut consumed: BTreeMap<(DevKey, String), Quantity> = BTreeMap::new();
        let mut used_counters: HashMap<(String, String, String, String), Quantity> = HashMap::new();
        let mut shared_devices: HashSet<DevKey> = HashSet::new();
        // Devices our new allocations touch: the in-use claims may already overbook among
        // themselves (the generator does not prevent it); only what we add is ours to answer for.
        let mut new_keys: HashSet<DevKey> = HashSet::new();
        let mut new_counters: HashSet<(String, String, String, String)> = HashSet::new();
        for (r, claim) in &results {
            let key: DevKey = (
                r["driver"].as_str().unwrap_or("").to_owned(),
                r["pool"].as_str().unwrap_or("").to_owned(),
                r["device"].as_str().unwrap_or("").to_owned(),
            );
            let new = claim.is_some();
            if new {
                new_keys.insert(key.clone());
            }
            let Some(sd) = devices.get(&key) else {
                if new {
                    out.push(format!("node {node_name}: {key:?} is not a current device"));
                }
                continue;
            };
            if r["adminAccess"] == json!(true) {
                continue;
            }
            if let Some(id) = r.get("shareID").and_then(Value::as_str) {
                if sd.device["allowMultipleAllocations"] != json!(true) && new {
                    out.push(format!(
                        "node {node_name}: {key:?} shared but does not allow multiple allocations"
                    ));
                }
                if !shared_ids.insert(format!("{key:?}/{id}")) && new {
                    out.push(format!(
                        "node {node_name}: share ID {id} of {key:?} used twice"
                    ));
                }
                shared_devices.insert(key.clone());
                for (cap, v) in r["consumedCapacity"].as_object().into_iter().flatten() {
                    if let Some(qv) = q(v) {
                        let e = consumed
                            .entry((key.clone(), cap.clone()))
                            .or_insert_with(|| Quantity::from_int(0));
                        if let Ok(sum) = e.add(&qv) {
                            *e = sum;
                        }
                    }
                }
            } else if !exclusive.insert(key.clone()) && new {
                out.push(format!("node {node_name}: {key:?} allocated twice"));
            }
            for cc in sd.device["consumesCounters"]
                .as_array()
                .into_iter()
                .flatten()
            {
                for (c, v) in cc["counters"].as_object().into_iter().flatten() {
                    if let Some(qv) = q(&v["value"]) {
                        let k = (
                            key.0.clone(),
                            key.1.clone(),
                            cc["counterSet"].as_str().unwrap_or("").to_owned(),
                            c.clone(),
                        );
                        if new {
                            new_counters.insert(k.clone());
                        }
                        let e = used_counters
                            .entry(k)
                            .or_insert_with(|| Quantity::from_int(0));
                        if let Ok(sum) = e.add(&qv) {
                            *e = sum;
                        }
                    }
                }
            }
            if let Some(claim) = claim {
                selectors(claim, r, sd, &classes, &compiler, node_name, &mut out);
            }
        }
        for key in shared_devices
            .intersection(&exclusive)
            .filter(|k| new_keys.contains(*k))
        {
            out.push(format!(
                "node {node_name}: {key:?} both shared and exclusive"
            ));
        }
        for ((key, cap), used) in &consumed {
            let Some(sd) = devices.get(key) else { continue };
            if !new_keys.contains(key) {
                continue;
            }
            if let Some(total) = lookup(&sd.device["capacity"], &key.0, cap)
                .or_else(|| sd.device["capacity"].get(cap))
                .and_then(|c| q(&c["value"]))
                && used.compare(&total).is_gt()
            {
                out.push(format!(
                    "node {node_name}: {key:?} capacity {cap}: {used} consumed of {total}"
                ));
            }
        }
        for (k, used) in used_counters
            .iter()
            .filter(|(k, _)| new_counters.contains(*k))
        {
            match counters.get(k) {
                Some(total) if used.compare(total).is_gt() => {
                    out.push(format!(
                        "node {node_name}: counter {k:?}: {used} used of {total}"
                    ));
                }
                None => out.push(format!("node {node_name}: counter {k:?} does not exist")),
                _ => {}
            }
        }
    }
    out
}

/// The request (or subrequest) spec a result names.
fn request_spec<'a>(claim: &'a Value, request: &str) -> Option<&'a Value> {
    let (main, sub) = match request.split_once('/') {
        Some((m, s)) => (m, Some(s)),
        None => (request, None),
    };
    let req = claim
        .pointer("/spec/devices/requests")?
        .as_array()?
        .iter()
        .find(|r| r["name"] == main)?;
    match sub {
        None => req.get("exactly"),
        Some(s) => req["firstAvailable"]
            .as_array()?
            .iter()
            .find(|x| x["name"] == s),
    }
}

fn cel_device(driver: &str, device: &Value) -> Option<dra_cel::Device> {
    let mut capacity = serde_json::Map::new();
    for (k, v) in device["capacity"].as_object().into_iter().flatten() {
        capacity.insert(k.clone(), json!({"value": v["value"]}));
    }
    serde_json::from_value(json!({
        "driver": driver,
        "attributes": device.get("attributes").cloned().unwrap_or(json!({})),
        "capacity": capacity,
        "allowMultipleAllocations": device.get("allowMultipleAllocations").cloned(),
    }))
    .ok()
}

fn selectors(
    claim: &Value,
    result: &Value,
    sd: &SliceDev,
    classes: &HashMap<String, Value>,
    compiler: &Compiler,
    node: &str,
    out: &mut Vec<String>,
) {
    let request = result["request"].as_str().unwrap_or("");
    let Some(spec) = request_spec(claim, request) else {
        out.push(format!(
            "node {node}: result names unknown request {request}"
        ));
        return;
    };
    let driver = sd.slice["spec"]["driver"].as_str().unwrap_or("");
    let Some(device) = cel_device(driver, &sd.device) else {
        return;
    };
    let class = spec["deviceClassName"].as_str().unwrap_or("");
    let mut exprs: Vec<String> = Vec::new();
    if let Some(c) = classes.get(class) {
        for s in c["spec"]["selectors"].as_array().into_iter().flatten() {
            exprs.push(s["cel"]["expression"].as_str().unwrap_or("").to_owned());
        }
    } else {
        out.push(format!(
            "node {node}: request {request} allocated from missing class {class}"
        ));
    }
    for s in spec["selectors"].as_array().into_iter().flatten() {
        exprs.push(s["cel"]["expression"].as_str().unwrap_or("").to_owned());
    }
    for e in exprs {
        match compiler.compile(&e).map(|p| p.matches(&device)) {
            Ok(Ok(true)) => {}
            other => out.push(format!(
                "node {node}: {request} -> {}/{}: selector {e:?} gives {other:?}",
                result["pool"].as_str().unwrap_or(""),
                result["device"].as_str().unwrap_or("")
            )),
        }
    }
}

fn constraints(
    claim: &Value,
    results: &[Value],
    devices: &HashMap<DevKey, SliceDev>,
    node: &str,
    out: &mut Vec<String>,
) {
    for c in claim
        .pointer("/spec/devices/constraints")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let refs: Vec<&str> = c["requests"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        let applies = |request: &str| {
            refs.is_empty()
                || refs.contains(&request)
                || request
                    .split_once('/')
                    .is_some_and(|(m, _)| refs.contains(&m))
        };
        let (attr, matching) = match (
            c["matchAttribute"].as_str(),
            c["distinctAttribute"].as_str(),
        ) {
            (Some(a), _) => (a, true),
            (None, Some(a)) => (a, false),
            _ => continue,
        };
        let mut values: Vec<Value> = Vec::new();
        for r in results {
            if !applies(r["request"].as_str().unwrap_or("")) {
                continue;
            }
            let key = (
                r["driver"].as_str().unwrap_or("").to_owned(),
                r["pool"].as_str().unwrap_or("").to_owned(),
                r["device"].as_str().unwrap_or("").to_owned(),
            );
            let Some(sd) = devices.get(&key) else {
                continue;
            };
            match lookup(&sd.device["attributes"], &key.0, attr) {
                Some(v) => values.push(v.clone()),
                None => out.push(format!(
                    "node {node}: constraint on {attr}: {key:?} lacks it"
                )),
            }
        }
        if matching {
            if values.windows(2).any(|w| w[0] != w[1]) {
                out.push(format!(
                    "node {node}: matchAttribute {attr} violated: {values:?}"
                ));
            }
        } else {
            let set: HashSet<String> = values.iter().map(Value::to_string).collect();
            if set.len() != values.len() {
                out.push(format!(
                    "node {node}: distinctAttribute {attr} violated: {values:?}"
                ));
            }
        }
    }
}
