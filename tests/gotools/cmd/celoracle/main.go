// Command celoracle evaluates DRA CEL selector cases with the upstream Kubernetes implementation
// (k8s.io/dynamic-resource-allocation/cel, the code kube-scheduler and API validation run), so that
// drust's dra-cel crate can be compared against it case by case.
//
// Input: JSON Lines on stdin or in the file given as the only argument, one case per line:
//
//	{"expression": "...", "device": {"driver": "...", "attributes": {...}, "capacity": {...},
//	 "allowMultipleAllocations": true}, "environment": "stored"|"new",
//	 "features": {"consumableCapacity": true, "listTypeAttributes": false}}
//
// Output: one JSON line per case: {"result": true|false} or
// {"error": {"kind": "compile"|"runtime"|"cost"|"input", "message": "..."}}, plus "cost" (the
// actual runtime cost of an evaluation that returned a result) and "estimatedCost" (the
// compile-time worst case, "new" environment only) where known.
//
// Environments (mirroring the two upstream callers):
//   - "stored" (default): what the scheduler does for a stored selector. Compile in the
//     StoredExpressions environment without cost estimation (cel.Cache.GetOrCompile), then
//     DeviceMatches with the runtime cost limit resource.k8s.io CELSelectorExpressionMaxCost.
//   - "new": what API validation does for a new selector (pkg/apis/resource/validation,
//     validateCELSelector): reject an expression longer than CELSelectorExpressionMaxLength,
//     compile in the NewExpressions environment with cost estimation and reject an estimated
//     cost above CELSelectorExpressionMaxCost; a valid expression is then evaluated like "stored".
//
// Error classification:
//   - compile: expression too long ("new"), or CompilationResult.Error set (parse, type-check,
//     AST validators, result type not bool).
//   - cost: estimated cost above the limit ("new"), or the runtime cost limit was hit during
//     evaluation (cel-go's "actual cost limit exceeded").
//   - runtime: any other DeviceMatches error (including a device attribute that cannot be
//     converted, e.g. an invalid version).
//   - input: the case itself could not be decoded.
//
// Features default to the kube-apiserver v1.36 defaults: DRAConsumableCapacity on (beta),
// DRAListTypeAttributes off (alpha).
//
// With -bench N, the command instead times compilation and evaluation over the cases and prints
// one JSON object with the figures (see timing below).
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apiserver/pkg/cel/environment"
	dracel "k8s.io/dynamic-resource-allocation/cel"
)

type features struct {
	ConsumableCapacity *bool `json:"consumableCapacity,omitempty"`
	ListTypeAttributes *bool `json:"listTypeAttributes,omitempty"`
}

type device struct {
	Driver                   string                                                    `json:"driver"`
	Attributes               map[resourceapi.QualifiedName]resourceapi.DeviceAttribute `json:"attributes,omitempty"`
	Capacity                 map[resourceapi.QualifiedName]resourceapi.DeviceCapacity  `json:"capacity,omitempty"`
	AllowMultipleAllocations *bool                                                     `json:"allowMultipleAllocations,omitempty"`
}

type testCase struct {
	Expression  string    `json:"expression"`
	Device      device    `json:"device"`
	Environment string    `json:"environment,omitempty"`
	Features    *features `json:"features,omitempty"`
}

type errorOut struct {
	Kind    string `json:"kind"`
	Message string `json:"message"`
}

type output struct {
	Result *bool     `json:"result,omitempty"`
	Error  *errorOut `json:"error,omitempty"`
	// Cost is the actual runtime cost of an evaluation that returned a result.
	Cost *uint64 `json:"cost,omitempty"`
	// EstimatedCost is the compile-time worst-case estimate ("new" environment only).
	EstimatedCost *uint64 `json:"estimatedCost,omitempty"`
}

func (c *testCase) dracelFeatures() dracel.Features {
	f := dracel.Features{EnableConsumableCapacity: true, EnableListTypeAttributes: false}
	if c.Features != nil {
		if c.Features.ConsumableCapacity != nil {
			f.EnableConsumableCapacity = *c.Features.ConsumableCapacity
		}
		if c.Features.ListTypeAttributes != nil {
			f.EnableListTypeAttributes = *c.Features.ListTypeAttributes
		}
	}
	return f
}

func fail(kind, message string) output {
	return output{Error: &errorOut{Kind: kind, Message: message}}
}

// compile mirrors the caller selected by the case's environment; it returns a failed output or
// the compiled expression.
func compile(c *testCase) (*dracel.CompilationResult, *output) {
	compiler := dracel.GetCompiler(c.dracelFeatures())
	switch c.Environment {
	case "", "stored":
		envType := environment.StoredExpressions
		result := compiler.CompileCELExpression(c.Expression, dracel.Options{EnvType: &envType, DisableCostEstimation: true})
		if result.Error != nil {
			out := fail("compile", result.Error.Detail)
			return nil, &out
		}
		return &result, nil
	case "new":
		if len(c.Expression) > resourceapi.CELSelectorExpressionMaxLength {
			out := fail("compile", fmt.Sprintf("expression too long: may not be more than %d bytes", resourceapi.CELSelectorExpressionMaxLength))
			return nil, &out
		}
		envType := environment.NewExpressions
		result := compiler.CompileCELExpression(c.Expression, dracel.Options{EnvType: &envType})
		if result.Error != nil {
			out := fail("compile", result.Error.Detail)
			return nil, &out
		}
		if result.MaxCost > resourceapi.CELSelectorExpressionMaxCost {
			out := fail("cost", fmt.Sprintf("too complex, exceeds cost limit: estimated cost %d", result.MaxCost))
			out.EstimatedCost = &result.MaxCost
			return nil, &out
		}
		return &result, nil
	default:
		out := fail("input", fmt.Sprintf("unknown environment %q", c.Environment))
		return nil, &out
	}
}

func toDevice(d *device) dracel.Device {
	return dracel.Device{
		Driver:                   d.Driver,
		AllowMultipleAllocations: d.AllowMultipleAllocations,
		Attributes:               d.Attributes,
		Capacity:                 d.Capacity,
	}
}

func evaluate(ctx context.Context, c *testCase) output {
	result, failed := compile(c)
	if failed != nil {
		return *failed
	}
	var estimated *uint64
	if c.Environment == "new" {
		estimated = &result.MaxCost
	}
	matches, details, err := result.DeviceMatches(ctx, toDevice(&c.Device))
	if err != nil {
		msg := err.Error()
		var out output
		if strings.Contains(msg, "actual cost limit exceeded") {
			out = fail("cost", msg)
		} else {
			out = fail("runtime", msg)
		}
		out.EstimatedCost = estimated
		return out
	}
	out := output{Result: &matches, EstimatedCost: estimated}
	if details != nil {
		out.Cost = details.ActualCost()
	}
	return out
}

func readCases(r io.Reader) ([]*testCase, []*output, error) {
	scanner := bufio.NewScanner(r)
	scanner.Buffer(make([]byte, 1<<20), 64<<20)
	var cases []*testCase
	var decodeErrors []*output
	for scanner.Scan() {
		line := strings.TrimSpace(scanner.Text())
		if line == "" {
			continue
		}
		c := &testCase{}
		dec := json.NewDecoder(strings.NewReader(line))
		if err := dec.Decode(c); err != nil {
			out := fail("input", err.Error())
			cases = append(cases, nil)
			decodeErrors = append(decodeErrors, &out)
			continue
		}
		cases = append(cases, c)
		decodeErrors = append(decodeErrors, nil)
	}
	return cases, decodeErrors, scanner.Err()
}

// timing is the -bench output: compile is the mean over all cases' expressions (each compiled
// once per iteration, as a cache miss would), eval the mean DeviceMatches call (which builds the
// activation from the ResourceSlice device) over the cases that compiled.
type timing struct {
	Implementation     string  `json:"implementation"`
	Cases              int     `json:"cases"`
	EvalCases          int     `json:"evalCases"`
	Iterations         int     `json:"iterations"`
	CompileMicrosPerEx float64 `json:"compileMicrosPerExpression"`
	EvalNanosPerCase   float64 `json:"evalNanosPerSelectorDevice"`
}

func bench(cases []*testCase, iterations int) timing {
	ctx := context.Background()
	var valid []*testCase
	for _, c := range cases {
		if c != nil {
			valid = append(valid, c)
		}
	}
	// Warm up the compilers (one per feature set) outside the timed region.
	for _, c := range valid {
		compile(c)
	}
	start := time.Now()
	compiled := 0
	for i := 0; i < iterations; i++ {
		for _, c := range valid {
			compile(c)
			compiled++
		}
	}
	compileElapsed := time.Since(start)

	type prepared struct {
		result *dracel.CompilationResult
		device dracel.Device
	}
	var programs []prepared
	for _, c := range valid {
		if r, failed := compile(c); failed == nil {
			programs = append(programs, prepared{result: r, device: toDevice(&c.Device)})
		}
	}
	evalIterations := iterations * 10
	start = time.Now()
	evaluated := 0
	for i := 0; i < evalIterations; i++ {
		for _, p := range programs {
			_, _, _ = p.result.DeviceMatches(ctx, p.device)
			evaluated++
		}
	}
	evalElapsed := time.Since(start)
	t := timing{Implementation: "upstream k8s.io/dynamic-resource-allocation/cel v0.36.3", Cases: len(valid), EvalCases: len(programs), Iterations: iterations}
	if compiled > 0 {
		t.CompileMicrosPerEx = float64(compileElapsed.Nanoseconds()) / 1000 / float64(compiled)
	}
	if evaluated > 0 {
		t.EvalNanosPerCase = float64(evalElapsed.Nanoseconds()) / float64(evaluated)
	}
	return t
}

func main() {
	benchIterations := flag.Int("bench", 0, "time compile and eval over the cases with this many iterations instead of printing results")
	flag.Parse()
	in := io.Reader(os.Stdin)
	if flag.NArg() > 0 {
		f, err := os.Open(flag.Arg(0))
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		defer f.Close()
		in = f
	}
	cases, decodeErrors, err := readCases(in)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	w := bufio.NewWriter(os.Stdout)
	defer w.Flush()
	enc := json.NewEncoder(w)
	enc.SetEscapeHTML(false)
	if *benchIterations > 0 {
		if err := enc.Encode(bench(cases, *benchIterations)); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		return
	}
	for i, c := range cases {
		var out output
		if c == nil {
			out = *decodeErrors[i]
		} else {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			out = evaluate(ctx, c)
			cancel()
		}
		if err := enc.Encode(out); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
	}
}
